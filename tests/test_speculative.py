"""Speculative decoding: the n-gram (prompt lookup) proposer against a plain Python reference."""
from __future__ import annotations

import random

import pytest

from lmd.kernels import ops


def ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What ``ops.ngram_propose`` promises, written the slow way."""
    n = len(tokens)
    for m in range(min(max_n, n - 1), min_n - 1, -1):
        starts = [i for i in range(n - m) if tokens[i:i + m] == tokens[n - m:]]
        if starts and k:
            text = list(tokens)
            i = starts[-1]
            for j in range(k):  # an overlapping copy: the draft continues from what it drafted
                text.append(text[i + m + j])
            return text[n:]
    return []


def test_ngram_examples():
    assert ops.ngram_propose([1, 2, 3, 4, 1, 2], 1, 3, 2) == [3, 4]
    assert ops.ngram_propose([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1, 2]   # the latest occurrence
    assert ops.ngram_propose([8, 8, 8], 1, 2, 4) == [8, 8, 8, 8]                   # a run repeats
    assert ops.ngram_propose([1, 2, 1, 2, 1], 1, 4, 5) == [2, 1, 2, 1, 2]          # and a period
    assert ops.ngram_propose([1, 2, 3], 1, 3, 4) == []                             # nothing seen twice
    assert ops.ngram_propose([1, 2, 1, 2], 3, 3, 4) == []                          # shorter than min_n
    assert ops.ngram_propose([1, 1], 1, 1, 0) == []
    assert ops.ngram_propose([], 1, 3, 2) == []


def test_ngram_matches_reference_on_random_text():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(0, 8)
        assert ops.ngram_propose(tokens, min_n, max_n, k) == ngram_reference(tokens, min_n, max_n, k), \
            (tokens, min_n, max_n, k)


@pytest.mark.parametrize('args', [(0, 2, 3), (3, 2, 1), (1, 2, -1)])
def test_ngram_bad_arguments_are_named(args):
    with pytest.raises(ValueError, match='min_n'):
        ops.ngram_propose([1, 2, 3], *args)


# ---- the PyTorch engine ------------------------------------------------------------------------------------


import torch  # noqa: E402

from lmd.engine import EngineRequest, SamplingParams  # noqa: E402
from lmd.messages import PytorchEngineConfig, SpeculativeConfig  # noqa: E402
from lmd.pytorch_backend import PytorchEngine  # noqa: E402
from lmd.pytorch_backend.speculative import NgramProposer  # noqa: E402
from test_pytorch_engine import TINY, Collector, assert_no_leak  # noqa: E402
from tiny_models import saved_models, tiny_hf_model  # noqa: E402

# the fixed length: these tests count drafts, and the adaptive length follows the step times (test_adaptive_*)
NGRAM = SpeculativeConfig(method='ngram', num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                          adaptive_draft_length=False)


@pytest.fixture(scope='module')
def tiny_llama(tmp_path_factory):
    return saved_models(tmp_path_factory, lambda _: tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', **TINY,
                                                                  tie_word_embeddings=True))('llama')


def pt_engine(model_dir, spec=None, **cfg):
    cfg = dict(dict(cache_block_seq_len=8, num_cache_blocks=256, max_prefill_token_num=48), **cfg)
    return PytorchEngine(model_dir, PytorchEngineConfig(speculative_config=spec, **cfg))


def looping_prompts(rng, n):
    """Prompts that repeat a phrase, so that prompt lookup drafts from the first step, and random ones."""
    out = []
    for i in range(n):
        phrase = [rng.randrange(512) for _ in range(rng.randint(3, 7))]
        out.append(phrase * rng.randint(2, 4) if i % 3 else [rng.randrange(512) for _ in range(20)])
    return out


def run(engine, prompts, sampling) -> Collector:
    col = Collector()
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        engine.add_request(EngineRequest(i, tuple(p), sp), col.callback)
    col.wait(range(len(prompts)))
    return col


def logprobs_of(col, sid) -> list[dict]:
    return [lp for o in col.outputs[sid] for lp in (o.logprobs or ())]


def assert_same_outputs(got, want, n: int) -> None:
    """Requests 0..n-1 got the tokens and finish reasons they get without speculation, and request 1's 40
    logprobs: a verification row's logits are the one-row step's within float error."""
    for i in range(n):
        assert got.tokens(i) == want.tokens(i), i
        assert got.final(i).finish_reason == want.final(i).finish_reason, i
    got_lps, want_lps = logprobs_of(got, 1), logprobs_of(want, 1)
    assert len(got_lps) == len(want_lps) == 40
    for g, w in zip(got_lps, want_lps):
        assert list(g) == list(w) and max(abs(g[t] - w[t]) for t in g) < 1e-4


def test_pytorch_greedy_with_drafts_is_the_output_without(tiny_llama):
    rng = random.Random(3)
    prompts = looping_prompts(rng, 9)
    sampling = [SamplingParams(max_new_tokens=40),
                SamplingParams(max_new_tokens=40, logprobs=2),
                SamplingParams(max_new_tokens=40, repetition_penalty=1.3),
                SamplingParams(max_new_tokens=7),
                SamplingParams(max_new_tokens=40, stop_token_ids=(prompts[4][-1],)),
                SamplingParams(max_new_tokens=40, min_new_tokens=10, stop_token_ids=(prompts[5][0],)),
                SamplingParams(max_new_tokens=40, frequency_penalty=0.5),
                SamplingParams(max_new_tokens=33),
                SamplingParams(max_new_tokens=40, bad_token_ids=(prompts[8][1],))]
    with pt_engine(tiny_llama[1]) as engine:
        want = run(engine, prompts, sampling)
    # chunks of 24 tokens: drafts are cut to the budget when prefills share the step
    with pt_engine(tiny_llama[1], NGRAM, max_prefill_token_num=24) as engine:
        got = run(engine, prompts, sampling)
        stats = engine.stats()
        assert_no_leak(engine)
    assert_same_outputs(got, want, len(prompts))
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens, stats


class ModelGreedyProposer:
    """Drafts an HF model's own greedy continuation, as many tokens as the engine's proposer would: a draft
    model that is the target itself, so that sampled requests see drafts accepted and rejected alike."""

    def __init__(self, model, proposer):
        self.model, self.proposer = model, proposer
        self.retain, self.begin_step = proposer.retain, proposer.begin_step
        self.observe, self.observe_step = proposer.observe, proposer.observe_step

    draft = NgramProposer.draft  # its own propose for each running sequence

    @torch.no_grad()
    def propose(self, seq):
        ids, draft = list(seq.token_ids), []
        for _ in range(self.proposer.draft_len(seq)):
            draft.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(draft[-1])
        return tuple(draft)


def test_pytorch_adaptive_draft_length_is_the_output_without(tiny_llama):
    """The default adaptive length drafts what its timing fit says pays, whatever that is on this
    machine: the output is the one without speculation, and no draft exceeds num_speculative_tokens."""
    rng = random.Random(4)
    prompts = looping_prompts(rng, 4)
    sampling = [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, logprobs=2),
                SamplingParams(max_new_tokens=40, repetition_penalty=1.3), SamplingParams(max_new_tokens=29)]
    with pt_engine(tiny_llama[1]) as engine:
        want = run(engine, prompts, sampling)
    adaptive = SpeculativeConfig(method='ngram', num_speculative_tokens=4, prompt_lookup_max=3)
    with pt_engine(tiny_llama[1], adaptive) as engine:
        assert engine.proposer.lengths is not None
        got = run(engine, prompts, sampling)
        stats = engine.stats()
        assert_no_leak(engine)
    assert_same_outputs(got, want, len(prompts))
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens <= 4 * stats.spec_num_drafts, stats


def test_pytorch_sampled_with_drafts_is_the_sample_without(tiny_llama):
    """Verification draws each row's token from the request's own generator, one draw per token as
    without speculation, and accepts a draft only when the draw is that token (rejection sampling with
    a deterministic draft): a seeded request samples the very tokens it samples without drafts, so the
    law of the output is the target's. Drafts here are the model's own greedy continuation, accepted
    and rejected alike."""
    rng = random.Random(5)
    prompt = [rng.randrange(512) for _ in range(4)] * 3
    n = 48
    sampling = [SamplingParams(max_new_tokens=5, greedy=False, temperature=0.8, top_k=4, random_seed=s)
                for s in range(n)]

    def sample(spec=None, drafts_of=None):
        with pt_engine(tiny_llama[1], spec, num_cache_blocks=512, max_batch_size=n,
                       max_prefill_token_num=2048) as engine:
            if drafts_of is not None:
                engine.proposer = ModelGreedyProposer(drafts_of, engine.proposer)
            col = run(engine, [prompt] * n, sampling)
            stats = engine.stats()
            assert_no_leak(engine)
        return [col.tokens(i) for i in range(n)], stats

    want, _ = sample()
    got, stats = sample(NGRAM, drafts_of=tiny_llama[0])
    assert got == want
    assert len({tuple(t) for t in want}) > 10  # the seeds do sample different texts
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats


def test_pytorch_drafts_with_prefix_caching_and_sliding_out_of_blocks(tiny_llama):
    rng = random.Random(7)
    prompts = looping_prompts(rng, 6)
    sampling = [SamplingParams(max_new_tokens=30)] * 6
    with pt_engine(tiny_llama[1]) as engine:
        want = run(engine, prompts, sampling)
    # few blocks: preemptions recompute sequences whose drafts were rolled back; the cache then serves
    # the same prompts again from blocks that drafts never wrote into the index
    with pt_engine(tiny_llama[1], NGRAM, num_cache_blocks=24, enable_prefix_caching=True) as engine:
        first = run(engine, prompts, sampling)
        again = run(engine, prompts, sampling)
        stats = engine.stats()
        assert_no_leak(engine)
    for i in range(len(prompts)):
        assert first.tokens(i) == again.tokens(i) == want.tokens(i), i
    assert stats.num_prefix_hit_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats


def test_pytorch_draft_model_greedy_is_the_output_without(tiny_llama, tmp_path):
    """A draft model (draft_target): the target itself drafting for plain greedy requests has every draft taken;
    a different random model of the same vocabulary has most rejected, in a batch of greedy, logprobs, penalty,
    seeded sampled and stopping requests: the output is the target's either way, and the draft cache's shadows
    are freed with their sequences."""
    other = tmp_path / 'draft'
    tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', seed=9, **TINY, tie_word_embeddings=True)[0].save_pretrained(other)
    rng = random.Random(11)
    prompts = looping_prompts(rng, 6)
    greedy = [SamplingParams(max_new_tokens=24)] * 6
    mixed = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24, logprobs=1),
             SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=24, repetition_penalty=1.2),
             SamplingParams(max_new_tokens=24, greedy=False, temperature=0.9, random_seed=3),
             SamplingParams(max_new_tokens=24, stop_token_ids=(prompts[5][2],))]
    for draft, sampling in ((tiny_llama[1], greedy), (str(other), mixed)):
        with pt_engine(tiny_llama[1]) as engine:
            want = run(engine, prompts, sampling)
        spec = SpeculativeConfig(method='draft_target', model=draft, num_speculative_tokens=3,
                                 adaptive_draft_length=False)
        with pt_engine(tiny_llama[1], spec) as engine:
            got = run(engine, prompts, sampling)
            stats = engine.stats()
            assert_no_leak(engine)
            # what the next step does once nothing runs
            engine.call_on_engine_thread(lambda e: e.proposer.retain([]))
            assert engine.call_on_engine_thread(lambda e: e.proposer.block_manager.num_free_blocks) == 256
        for i in range(len(prompts)):
            assert got.tokens(i) == want.tokens(i), (draft, i)
        for g, w in zip(logprobs_of(got, 1), logprobs_of(want, 1)):
            assert list(g) == list(w) and max(abs(g[t] - w[t]) for t in g) < 1e-4
        assert stats.spec_num_draft_tokens > 0, stats
        if sampling is greedy:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, stats


def test_draft_model_of_another_vocabulary_is_refused(tiny_llama, tmp_path):
    other = tmp_path / 'draft'
    tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', **dict(TINY, vocab_size=256))[0].save_pretrained(other)
    spec = SpeculativeConfig(method='draft_target', model=str(other), adaptive_draft_length=False)
    with pytest.raises(ValueError, match='vocabulary has 256 tokens'):
        pt_engine(tiny_llama[1], spec)


# ---- end to end: the api_server with --speculative-algorithm ngram, SmolLM2 ---------------------------------

REWRITE = ('Copy this sentence exactly, word for word, and nothing else: "The old lighthouse keeper climbed the '
           'narrow stairs every evening to light the lamp for the fishing boats."')
PERSON = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': {
    'type': 'object', 'properties': {'name': {'type': 'string'}, 'age': {'type': 'integer'}},
    'required': ['name', 'age']}}}


def test_api_server_speculates_and_answers_as_without(smollm2_dir):
    import openai

    from lmd import GenerationConfig, pipeline
    from server_utils import api_server, metric

    msgs = [{'role': 'user', 'content': REWRITE}]
    json_msgs = [{'role': 'user', 'content': 'Describe the keeper of the lighthouse as JSON.'}]
    with pipeline(smollm2_dir, backend='pytorch', backend_config=PytorchEngineConfig(session_len=1024)) as pipe:
        want = pipe(msgs, GenerationConfig(max_new_tokens=48, logprobs=2))
        want_json = pipe(json_msgs, GenerationConfig(max_new_tokens=40, response_format=PERSON))
    with api_server(smollm2_dir, '--backend', 'pytorch', '--session-len', '1024', '--speculative-algorithm', 'ngram',
                    '--speculative-num-draft-tokens', '4') as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + '/v1', api_key='none')
        model = client.models.list().data[0].id
        got = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=48,
                                             logprobs=True, top_logprobs=2)
        accepted = metric(server.url, 'lmd:spec_decode_num_accepted_tokens_total')
        drafted = metric(server.url, 'lmd:spec_decode_num_draft_tokens_total')
        got_json = client.chat.completions.create(model=model, messages=json_msgs, temperature=0, max_tokens=40,
                                                  response_format=PERSON)
    assert got.choices[0].message.content == want.text
    got_lps = [t.logprob for t in got.choices[0].logprobs.content]
    want_lps = [lp[t] for t, lp in zip(want.token_ids, want.logprobs)]
    assert len(got_lps) == len(want_lps) and max(abs(a - b) for a, b in zip(got_lps, want_lps)) < 1e-4
    assert got_json.choices[0].message.content == want_json.text
    # copying a sentence is what prompt lookup drafts well: most drafted tokens are taken
    assert drafted > 0 and accepted > 0.7 * drafted, (accepted, drafted)


def test_stop_string_inside_a_drafted_step_ends_the_answer_there(smollm2_dir):
    """TurboMind hands a verified step's tokens over in one output: the answer still ends at the token that
    completes a stop string, its token ids and length as without speculation."""
    from lmd import GenerationConfig, TurbomindEngineConfig, pipeline
    msgs = [{'role': 'user', 'content': REWRITE}]
    gen = GenerationConfig(max_new_tokens=48, stop_words=['lamp'])
    answers = []
    for spec in (None, NGRAM):
        config = TurbomindEngineConfig(session_len=1024, speculative_config=spec)
        with pipeline(smollm2_dir, backend='turbomind', backend_config=config) as pipe:
            answers.append(pipe(msgs, gen))
            stats = pipe.async_engine.stats()
    want, got = answers
    assert want.finish_reason == got.finish_reason == 'stop' and 'lamp' not in want.text
    assert (got.text, got.token_ids, got.generate_token_len) == (want.text, want.token_ids, want.generate_token_len)
    assert stats.spec_num_accepted_tokens > 0, stats
