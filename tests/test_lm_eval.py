"""lm-evaluation-harness against the api_server, end to end: its ``local-completions`` model (with its
remote tokenizer on the server's ``/tokenize``) runs a small local multiple-choice task, and every
sample's loglikelihoods equal those of lm-eval's own ``hf`` model on the same float32 weights.

Under it, what lm-eval sends: ``/v1/completions`` with ``echo`` and ``logprobs`` (the prompt tokens'
logprobs first, the first null), ``max_tokens: 0``, and vLLM's ``prompt_logprobs`` on both routes,
each against HF transformers' teacher-forced logits."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import transformers

from server_utils import api_server, tiny_model_dir

DOCS = [
    {'question': 'The capital of France is', 'choices': [' Paris', ' London', ' Rome'], 'answer': 0},
    {'question': 'Two plus two equals', 'choices': [' four', ' five', ' twenty-two'], 'answer': 0},
    {'question': 'On a clear day the sky is', 'choices': [' blue', ' green', ' red'], 'answer': 0},
    {'question': 'Water freezes at zero degrees', 'choices': [' Celsius', ' Fahrenheit', ' Kelvin'], 'answer': 0},
]
TASK = """task: lmd_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TOL = 1e-3


@pytest.fixture(scope='module')
def model_dir(smollm2_dir, tmp_path_factory):
    """A tiny random Llama in float32 over SmolLM2's tokenizer."""
    return tiny_model_dir(str(tmp_path_factory.mktemp('tiny_eval')), smollm2_dir)


@pytest.fixture(scope='module')
def server(model_dir):
    with api_server(model_dir, '--backend', 'turbomind', '--session-len', '256', '--model-name', 'tiny',
                    '--enable-prefix-caching', '--log-level', 'WARNING') as s:
        yield s.wait_ready()


@pytest.fixture(scope='module')
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server.url + '/v1', api_key='none', max_retries=0)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_lm_eval_local_completions_equals_its_hf_model(server, model_dir, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')  # the task's data is a local file
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    docs = tmp_path / 'docs.jsonl'
    docs.write_text(''.join(json.dumps(d) + '\n' for d in DOCS))
    (tmp_path / 'lmd_tiny_mc.yaml').write_text(TASK.format(docs=docs))
    tasks = TaskManager(include_path=str(tmp_path))

    def evaluate(model: str, args: dict) -> list[dict]:
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=['lmd_tiny_mc'], task_manager=tasks,
                                      log_samples=True)
        return sorted(out['samples']['lmd_tiny_mc'], key=lambda s: s['doc_id'])

    served = evaluate('local-completions', {'base_url': server.url + '/v1/completions', 'model': 'tiny',
                                            'tokenizer_backend': 'remote', 'max_retries': 1})
    reference = evaluate('hf', {'pretrained': model_dir, 'dtype': 'float32', 'device': 'cpu'})
    assert [s['doc_id'] for s in served] == [s['doc_id'] for s in reference] == list(range(len(DOCS)))
    for got, want in zip(served, reference):
        assert len(got['filtered_resps']) == len(DOCS[got['doc_id']]['choices'])
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got['filtered_resps'], want['filtered_resps']):
            assert abs(ll - ref_ll) < TOL, (got['doc_id'], ll, ref_ll)
            assert greedy == ref_greedy
        assert got['acc'] == want['acc']


def test_echo_logprobs_are_the_prompts_then_the_answers(client, hf_model):
    ids = [504, 3575, 282, 4649, 314, 12, 1135, 2113]
    ref = hf_logprobs(hf_model, ids)
    r = client.completions.create(model='tiny', prompt=ids, echo=True, logprobs=2, max_tokens=2, temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < TOL
        assert sorted(lp.top_logprobs[p].values(), reverse=True) == pytest.approx(
            ref[p - 1].topk(2).values.tolist(), abs=TOL)
    greedy = int(ref[-1].argmax())
    assert abs(lp.token_logprobs[len(ids)] - ref[-1, greedy].item()) < TOL  # the answer's first token
    assert c.text.startswith(''.join(lp.tokens[:len(ids)]))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(ids)] == len(''.join(lp.tokens[:len(ids)]))
    assert r.usage.completion_tokens == 2

    # max_tokens 0: the prompt alone, scored
    r0 = client.completions.create(model='tiny', prompt=ids, echo=True, logprobs=0, max_tokens=0)
    lp0 = r0.choices[0].logprobs
    assert r0.choices[0].finish_reason == 'length' and r0.usage.completion_tokens == 0
    assert lp0.tokens == lp.tokens[:len(ids)]
    assert lp0.token_logprobs == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-5)
    assert lp0.top_logprobs[0] is None


def test_vllm_prompt_logprobs_on_both_routes(server, hf_model):
    ids = [504, 3575, 282, 4649, 314, 12]
    ref = hf_logprobs(hf_model, ids)
    r = httpx.post(server.url + '/v1/completions', json={'prompt': ids, 'max_tokens': 0, 'prompt_logprobs': 3},
                   timeout=60).json()
    plp = r['choices'][0]['prompt_logprobs']
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        assert next(iter(entry)) == str(ids[p])
        assert abs(entry[str(ids[p])]['logprob'] - ref[p - 1, ids[p]].item()) < TOL
        best = ref[p - 1].topk(3)
        for rank, (tid, v) in enumerate(zip(best.indices.tolist(), best.values.tolist()), 1):
            assert entry[str(tid)]['rank'] == rank and abs(entry[str(tid)]['logprob'] - v) < TOL
            assert entry[str(tid)]['decoded_token']

    chat = httpx.post(server.url + '/v1/chat/completions', timeout=60, json={
        'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 1, 'prompt_logprobs': 0}).json()
    prompt_ids = httpx.post(server.url + '/tokenize', json={'messages': [{'role': 'user', 'content': 'Hi'}]}).json()
    assert len(chat['prompt_logprobs']) == chat['usage']['prompt_tokens'] == prompt_ids['count']
    ref = hf_logprobs(hf_model, prompt_ids['tokens'])
    assert chat['prompt_logprobs'][0] is None
    assert [e[str(t)]['logprob'] for e, t in zip(chat['prompt_logprobs'][1:], prompt_ids['tokens'][1:])] == \
        pytest.approx([ref[p, t].item() for p, t in enumerate(prompt_ids['tokens'][1:])], abs=TOL)


@pytest.mark.parametrize('route, body, param', [
    ('/v1/completions', {'prompt': 'a', 'max_tokens': 0}, 'max_tokens'),
    ('/v1/completions', {'prompt': 'a', 'prompt_logprobs': 1, 'stream': True}, 'prompt_logprobs'),
    ('/v1/completions', {'prompt': 'a', 'prompt_logprobs': 21}, 'prompt_logprobs'),
    ('/v1/completions', {'prompt': 'a', 'max_tokens': -1, 'echo': True}, 'max_tokens'),
    ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'a'}], 'prompt_logprobs': 1, 'stream': True},
     'prompt_logprobs'),
])
def test_bad_requests_name_the_field(server, route, body, param):
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()['error']['param'] == param, r.text
