"""benchmark/profile_triton.py: its pure parts, and one small run against a real api_server and a real
tritonserver (the ensemble and lmd_model, SmolLM2 on TurboMind). Timings are not checked (the machine
is shared); counts, checks and the report's shape are."""
from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
sys.path.insert(0, BENCH)
import profile_restful_api as rest
import profile_triton as bench
import serving_servers as servers


@pytest.fixture(scope='module')
def model_dir():
    from prompts import resolve_model_dir
    return resolve_model_dir('smollm2')


@pytest.fixture(scope='module')
def tokenizer(model_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(model_dir, 'tokenizer.json'))


@pytest.mark.parametrize('argv, message', [
    (['--paths', 'tgi'], "--paths: unknown ['tgi']"),
    (['--paths', 'ensemble,ensemble'], 'names a path twice'),
    (['--input-len', '10,5'], '1 <= LO <= HI'),
    (['--concurrency', '-1'], '--concurrency must be >= 0'),
    (['--backend', 'vllm'], "invalid choice: 'vllm'"),
    (['--postprocessing-instances', '0'], '--postprocessing-instances must be >= 1'),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_api_server_path_gets_the_same_workload_on_the_chat_endpoint():
    """Triton's ``prompt`` gets the chat template, so the api_server is measured on /v1/chat/completions;
    everything that shapes the load is passed through unchanged."""
    args = bench.parse_args(['--concurrency', '4', '--num-prompts', '7', '--input-len', '20,30', '--output-len', '5',
                             '--backend', 'pytorch', '--max-batch-size', '8', '--seed', '3', '--warmup', '1'])
    ra = bench.rest_args(args)
    assert ra.endpoint == 'chat' and ra.server_list == ['lmd-pytorch']
    assert (ra.concurrency, ra.num_prompts, ra.input_lo, ra.input_hi, ra.output_lo, ra.output_hi) == (4, 7, 20, 30, 5, 5)
    assert (ra.max_batch_size, ra.seed, ra.warmup, ra.request_rate) == (8, 3, 1, float('inf'))
    ra = bench.rest_args(bench.parse_args(['--model-format', 'hf']))
    assert ra.server_list == ['lmd-turbomind:hf']


def test_triton_inputs_follow_the_model_interface():
    import numpy as np
    req = rest.Request(0, (1, 2), 'Hello there', 7)
    inputs = {t.name(): t for t in bench.triton_inputs(req)}
    assert {n: (t.datatype(), t.shape()) for n, t in inputs.items()} == {
        'prompt': ('BYTES', [1]), 'max_tokens': ('INT32', [1]), 'temperature': ('FP32', [1]),
        'ignore_eos': ('BOOL', [1])}
    # the serialized tensors carry the values (BYTES: 4-byte length, then the UTF-8 text)
    assert inputs['prompt']._get_content() == len(b'Hello there').to_bytes(4, 'little') + b'Hello there'
    assert np.frombuffer(inputs['max_tokens']._get_content(), np.int32).tolist() == [7]
    assert np.frombuffer(inputs['temperature']._get_content(), np.float32).tolist() == [0.0]
    assert np.frombuffer(inputs['ignore_eos']._get_content(), np.bool_).tolist() == [True]


def test_a_length_finish_counts_max_tokens_and_the_text_is_checked(tokenizer):
    reqs = [rest.Request(0, (1,), 'a', 4), rest.Request(1, (1,), 'b', 4), rest.Request(2, (1,), 'c', 40)]
    done = bench.TritonResult(0, text=' one two three four', finish_reason='length', chunk_times=[1.0, 2.0])
    early = bench.TritonResult(1, text=' one two', finish_reason='stop', chunk_times=[1.0])
    failed = bench.TritonResult(2, error='boom')
    bench.count_tokens([done, early, failed], reqs, tokenizer)
    assert (done.completion_tokens, done.retokenized) == (4, 4)
    assert (early.completion_tokens, early.retokenized) == (2, 2)  # not 'length': the text's own count
    assert failed.completion_tokens is None
    # the summary's token check flags the early stop; the re-tokenized check the short text
    check = rest.token_check(reqs, [done, early], 'chat')
    assert check['output_mismatches'] == 1 and not check['ok']
    rt = bench.retokenize_check(reqs, {0: done.text, 1: early.text}, tokenizer)
    assert rt['minus_asked'] == {'min': -2, 'max': 0} and rt['outside_slack'] == 0 and rt['ok']  # merges happen
    rt = bench.retokenize_check(reqs, {2: ' one two', 0: ' one two three four five six seven'}, tokenizer)
    assert rt['outside_slack'] == 2 and not rt['ok']  # too short (pieces lost), too long (pieces repeated)
    assert rt['examples'] == [{'request': 0, 'asked': 4, 'retokenized': 7}, {'request': 2, 'asked': 40, 'retokenized': 2}]
    assert not bench.retokenize_check(reqs, {}, tokenizer)['ok']  # nothing checked is not a pass


def fake(path, tok_s, ttft_p99):
    return {'server': path, 'path': path, 'kind': 'lmd' if path == 'api_server' else 'triton', 'weights': 'w',
            'completed': 1, 'request_throughput': 1.0, 'output_tokens_per_s': tok_s,
            'total_tokens_per_s': tok_s * 2, 'ttft_ms': {'p99': ttft_p99}, 'token_check': {'ok': True}}


def test_table_has_a_ratio_column_per_triton_path_and_the_target_is_judged():
    results = [fake('api_server', 200.0, 100.0), fake('ensemble', 190.0, 150.0), fake('lmd_model', 170.0, 50.0)]
    lines = bench.ratio_table(results).splitlines()
    assert lines[0] == '| figure | api_server | ensemble | lmd_model | ensemble / api_server | lmd_model / api_server |'
    row = next(line for line in lines if line.startswith('| output tokens/s |'))
    assert row.split('|')[-3:-1] == [' 0.95 ', ' 0.85 ']
    row = next(line for line in lines if line.startswith('| TTFT P99 (ms) |'))
    assert row.split('|')[-3:-1] == [' 1.50 ', ' 0.50 ']
    t = bench.target(results)
    assert t == {'ensemble': {'output_tokens_per_s_ratio': 0.95, 'met': True},
                 'lmd_model': {'output_tokens_per_s_ratio': 0.85, 'met': False}}
    assert bench.target_line(t).endswith('ensemble 0.95x (met), lmd_model 0.85x (MISSED)')
    failed = {'server': 'ensemble', 'path': 'ensemble', 'kind': 'triton', 'weights': 'w', 'error': 'e'}
    assert bench.target([fake('api_server', 200.0, 1.0), failed]) == {}


def test_answers_are_compared_with_the_api_servers(tokenizer):
    reqs = [rest.Request(0, (1,), 'a', 2), rest.Request(1, (1,), 'b', 2)]
    r = {'path': 'ensemble', 'texts': {0: ' one two', 1: ' three four'}, 'token_check': {'ok': True}}
    bench.add_checks(r, reqs, tokenizer, {0: ' one two', 1: ' three five'})
    assert r['same_text_as_api_server'] == '1 of 2' and r['token_check']['ok']
    # the re-tokenized count judges Triton's text-only answers; the api_server's usage counts exactly
    long = {0: ' one two three four five six', 1: ' three four'}
    api = {'path': 'api_server', 'texts': long, 'token_check': {'ok': True}}
    bench.add_checks(api, reqs, tokenizer, None)
    assert api['token_check']['ok'] and not api['token_check']['retokenized']['ok']
    tri = {'path': 'lmd_model', 'texts': long, 'token_check': {'ok': True}}
    bench.add_checks(tri, reqs, tokenizer, long)
    assert not tri['token_check']['ok'] and tri['same_text_as_api_server'] == '2 of 2'
    block = bench.path_block({**r, 'server': 'ensemble', 'weights': 'w', 'completed': 2, 'failed': 0,
                              'duration_s': 1, 'request_throughput': 2, 'output_tokens_per_s': 4,
                              'total_tokens_per_s': 8, 'tokens_per_chunk': 1})
    assert block.splitlines()[-2:] == [f'{"re-tokenized - max_tokens":<34}0 .. 0',
                                       f'{"same answer as api_server":<34}1 of 2']


def test_an_unreachable_triton_fails_its_paths_with_the_reason(tmp_path, capsys):
    url = f'127.0.0.1:{servers.free_port()}'  # nothing listens there
    out = tmp_path / 'r.json'
    rc = bench.main(['--paths', 'ensemble,lmd_model', '--quick', '--triton-url', url, '--json', str(out)])
    assert rc == 2
    results = json.loads(out.read_text())['results']
    assert [r['path'] for r in results] == ['ensemble', 'lmd_model']
    for r in results:
        assert r['error'].startswith(f'{r["path"]}: RuntimeError: warmup failed: {r["path"]}: gRPC UNAVAILABLE')
        assert url in r['error']
    assert capsys.readouterr().out.count('FAILED:') == 2


def test_every_path_generates_exactly_what_was_asked(tmp_path, capsys):
    """A real api_server and a real tritonserver (repository from lmd.serve.triton.build_repository),
    started by the benchmark itself: every path completes every request with exactly max_tokens, every
    latency figure is filled, and the greedy answers agree with the api_server's."""
    out = tmp_path / 'r.json'
    rc = bench.main(['--paths', 'api_server,ensemble,lmd_model', '--num-prompts', '2', '--concurrency', '2',
                     '--input-len', '16,32', '--output-len', '4,6', '--warmup', '1', '--max-batch-size', '4',
                     '--startup-timeout', '180', '--json', str(out), '--log-dir', str(tmp_path / 'logs')])
    report = json.loads(out.read_text())
    results = {r['path']: r for r in report['results']}
    errors = {p: r.get('error') for p, r in results.items() if r.get('error')}
    assert rc == 0 and not errors, f'paths failed (a missing tritonserver says how to install it): {errors}'
    assert list(results) == ['api_server', 'ensemble', 'lmd_model']
    asked = report['workload']['output_tokens']['total']
    for path, r in results.items():
        assert r['completed'] == 2 and r['failed'] == 0, path
        assert r['output_tokens'] == asked, path
        assert r['token_check']['ok'] and r['token_check']['retokenized']['checked'] == 2, (path, r['token_check'])
        for m in ('ttft_ms', 'tpot_ms', 'e2e_ms'):
            assert r[m]['count'] > 0 and r[m]['p50'] > 0, (path, m)
        assert r['server_cpu_utilization'] > 0, path
    for path in ('ensemble', 'lmd_model'):
        assert results[path]['same_text_as_api_server'] == '2 of 2', results[path]['sample_text']
    assert set(report['target']) == {'ensemble', 'lmd_model'}
    printed = capsys.readouterr().out
    for head in ('==== api_server', '==== ensemble', '==== lmd_model', '| ensemble / api_server |', 'target: '):
        assert head in printed
