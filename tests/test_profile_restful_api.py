"""benchmark/profile_restful_api.py: its prompts, its client against a real lmd api_server, and
how it reports peers it cannot run. Timings are not checked (the machine is shared); counts are."""
from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
sys.path.insert(0, BENCH)
bench = pytest.importorskip('profile_restful_api')
pytest.importorskip('httpx', reason='the benchmark client needs httpx (comes with fastapi / openai)')


@pytest.fixture(scope='module')
def model_dir():
    from prompts import resolve_model_dir
    return resolve_model_dir('smollm2')


def test_prompts_have_exact_lengths_and_reencode(model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, 'tokenizer.json'))
    reqs = bench.build_requests(model_dir, 12, (20, 300), (5, 9), seed=3)
    assert [r.index for r in reqs] == list(range(12))
    for r in reqs:
        assert 20 <= r.input_len <= 300 and 5 <= r.output_len <= 9
        assert tuple(tok.encode(r.text, add_special_tokens=False).ids) == r.token_ids
    assert len({r.token_ids[:8] for r in reqs}) == 12  # different starting paragraphs
    again = bench.build_requests(model_dir, 12, (20, 300), (5, 9), seed=3)
    assert again == reqs  # the seed fixes the workload


@pytest.mark.parametrize('argv, message', [
    (['--servers', 'tgi'], "unknown ['tgi']"),
    (['--servers', 'vllm:float32'], "unknown ['vllm:float32']"),
    (['--input-len', '10,5'], '1 <= LO <= HI'),
    (['--request-rate', '0'], '--request-rate must be > 0'),
    (['--concurrency', '-1'], '--concurrency must be >= 0'),
    (['--repeats', '0'], '--repeats must be >= 1'),
    (['--endpoint', 'chat', '--prompt-format', 'ids'], '--prompt-format ids applies to --endpoint completions'),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_peers_say_what_to_run(tmp_path, capsys):
    out = tmp_path / 'r.json'
    rc = bench.main(['--servers', 'llama-server,vllm', '--quick', '--llama-server', str(tmp_path / 'no-llama-server'),
                     '--vllm-venv', str(tmp_path / 'no-venv'), '--json', str(out)])
    assert rc == 2
    results = {r['server']: r for r in json.loads(out.read_text())['results']}
    assert 'setup_llamacpp.sh' in results['llama-server']['error']
    assert 'setup_vllm_cpu.sh' in results['vllm']['error']
    assert capsys.readouterr().out.count('FAILED:') == 2


@pytest.mark.parametrize('endpoint', ['completions', 'chat'])
def test_lmd_server_generates_exactly_what_was_asked(endpoint, tmp_path, capsys):
    """A real lmd api_server (PyTorch engine, SmolLM2) started by the benchmark itself: every token
    asked for arrives, usage agrees, and every latency figure is filled."""
    pytest.importorskip('fastapi', reason='lmd serve needs fastapi')
    out = tmp_path / 'r.json'
    rc = bench.main(['--servers', 'lmd-pytorch', '--endpoint', endpoint, '--num-prompts', '3', '--concurrency', '2',
                     '--input-len', '16,40', '--output-len', '3,6', '--warmup', '1', '--json', str(out),
                     '--log-dir', str(tmp_path / 'logs')])
    report = json.loads(out.read_text())
    r = report['results'][0]
    assert rc == 0, r.get('error')
    asked = report['workload']['output_tokens']['total']
    assert r['completed'] == 3 and r['failed'] == 0
    assert r['output_tokens'] == asked
    assert r['token_check']['ok'] and r['token_check']['usage_reported'] == 3
    for m in ('ttft_ms', 'tpot_ms', 'itl_ms', 'e2e_ms'):
        assert r[m]['count'] > 0 and r[m]['p50'] > 0
    assert r['itl_ms']['count'] == asked - 3  # one token a chunk from lmd: n - 1 gaps per request
    if endpoint == 'chat':  # the chat template's tokens are counted by the server, not by the benchmark
        assert r['token_check']['prompt_tokens_minus_stated']['min'] > 0
    else:
        assert r['token_check']['prompt_mismatches'] == 0
    printed = capsys.readouterr().out
    assert '==== lmd-pytorch' in printed and '| output tokens/s |' in printed


def test_table_has_a_ratio_column_per_lmd_and_peer():
    def fake(name, kind, tok_s, ttft_p99):
        return {'server': name, 'kind': kind, 'weights': 'w', 'completed': 1, 'request_throughput': 1.0,
                'output_tokens_per_s': tok_s, 'total_tokens_per_s': tok_s * 2, 'ttft_ms': {'p99': ttft_p99},
                'token_check': {'ok': True}}
    table = bench.markdown_table([fake('lmd', 'lmd', 300.0, 100.0), fake('llama-server', 'llama-server', 150.0, 50.0),
                                  fake('vllm', 'vllm', 100.0, 200.0), {'server': 'x', 'kind': 'vllm', 'error': 'e'}])
    lines = table.splitlines()
    assert lines[0].endswith('| lmd / llama-server | lmd / vllm |')
    row = next(line for line in lines if line.startswith('| output tokens/s |'))
    assert row.split('|')[-3:-1] == [' 2.00 ', ' 3.00 ']
    row = next(line for line in lines if line.startswith('| TTFT P99 (ms) |'))
    assert row.split('|')[-3:-1] == [' 2.00 ', ' 0.50 ']


def test_repeats_keep_each_servers_best_good_run():
    def run(tok_s, ok=True, error=None):
        r = {'server': 'lmd', 'output_tokens_per_s': tok_s, 'ttft_ms': {'p99': 10.0 * tok_s},
             'token_check': {'ok': ok}}
        return {**r, 'error': error} if error else r
    one = run(5.0)
    assert bench.best_run([one]) is one                                  # a single run passes through as is
    best = bench.best_run([run(100.0), run(300.0, ok=False), run(200.0), run(0.0, error='died')])
    assert best['output_tokens_per_s'] == 200.0                          # a mismatched run is never chosen
    assert [r['output_tokens_per_s'] for r in best['runs']] == [100.0, 300.0, 200.0, 0.0]
    assert best['runs'][3]['error'] == 'died' and best['runs'][0]['ttft_p99_ms'] == 1000.0
    assert bench.best_run([run(0.0, error='a'), run(0.0, error='b')])['error'] == 'a'   # all failed: still reported
