"""Prompt logprobs (``SamplingParams.prompt_logprobs``) in both engines against HF transformers in
float32: read from the request's own prefill across chunked-prefill steps, never from the prefix
cache, beside requests that do not ask, with ``max_new_tokens=0`` (prefill only), and after a
preemption; the requests that cannot have them are refused."""
from __future__ import annotations

import threading

import pytest
import torch

from lmd.engine import EngineOutput, EngineRequest, SamplingParams
from lmd.messages import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig
from tiny_models import tiny_hf_model

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True)
# blocks of 8 tokens, 16 prompt tokens a step: a 48-token prompt takes three steps or more
ENGINE = dict(dtype='float32', cache_block_seq_len=8, max_prefill_token_num=16, enable_prefix_caching=True)
TOL = 1e-4


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    model, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', **TINY)
    path = str(tmp_path_factory.mktemp('tiny_llama'))
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def make_engine(backend: str, path: str, **cfg):
    cfg = {**ENGINE, **cfg}
    if backend == 'pytorch':
        from lmd.pytorch_backend import PytorchEngine
        return PytorchEngine(path, PytorchEngineConfig(**cfg))
    from lmd.turbomind.engine import TurbomindEngine
    return TurbomindEngine(path, TurbomindEngineConfig(**cfg))


@pytest.fixture(scope='module', params=['pytorch', 'turbomind'])
def engine(request, tiny):
    with make_engine(request.param, tiny[1], num_cache_blocks=128) as e:
        yield e


def run(engine, requests: list[EngineRequest], timeout: float = 120) -> dict[int, list[EngineOutput]]:
    """Submit all at once; every request's outputs once each has finished."""
    outputs: dict[int, list[EngineOutput]] = {r.session_id: [] for r in requests}
    cond = threading.Condition()

    def callback(out: EngineOutput):
        with cond:
            outputs[out.session_id].append(out)
            cond.notify_all()

    for r in requests:
        engine.add_request(r, callback)
    with cond:
        assert cond.wait_for(lambda: all(o and o[-1].finish_reason for o in outputs.values()), timeout)
    return outputs


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is log p(. | ids[:p + 1]), float32."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_prompt_logprobs(lps, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """One entry per prompt token: None first, then {the prompt's token first: its HF logprob, then HF's top k}."""
    assert lps is not None and len(lps) == len(ids)
    assert lps[0] is None
    for p in range(1, len(ids)):
        entry, row = lps[p], ref[p - 1]
        assert next(iter(entry)) == ids[p], f'position {p}: the prompt token is not first'
        for tid, lp in entry.items():
            assert abs(lp - row[tid].item()) < TOL, f'position {p}, token {tid}: {lp} vs HF {row[tid].item()}'
        alternatives = sorted((v for t, v in entry.items() if t != ids[p]), reverse=True)
        top = row.topk(k).values.tolist()
        want = [v for v in top if abs(v - row[ids[p]].item()) > TOL][:len(alternatives)]
        assert len(entry) in (k, k + 1)  # the prompt token, unless it is one of the k best
        assert alternatives == pytest.approx(want, abs=TOL), f'position {p}: not HF\'s top {k}'


def test_prompt_logprobs_equal_hf_across_chunks_and_a_cached_prefix(engine, tiny):
    model = tiny[0]
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 512, (40,), generator=g).tolist()
    # an earlier request leaves the shared prefix in the cache
    warm = run(engine, [EngineRequest(10, tuple(shared), SamplingParams(max_new_tokens=2))])
    assert warm[10][-1].finish_reason == 'length'

    with_prefix = shared[:36] + torch.randint(3, 512, (12,), generator=g).tolist()  # 4 cached blocks, 48 tokens
    other = torch.randint(3, 512, (30,), generator=g).tolist()
    out = run(engine, [
        EngineRequest(11, tuple(with_prefix), SamplingParams(max_new_tokens=3, prompt_logprobs=3)),
        EngineRequest(12, tuple(other), SamplingParams(max_new_tokens=3)),  # in the same steps, does not ask
        EngineRequest(13, tuple(shared), SamplingParams(max_new_tokens=0, prompt_logprobs=0)),  # prefill only
    ])
    first = out[11][0]
    check_prompt_logprobs(first.prompt_logprobs, with_prefix, hf_logprobs(model, with_prefix), 3)
    assert first.num_cached_tokens == 0  # read from its own prefill, not the cache
    assert all(o.prompt_logprobs is None for o in out[11][1:])  # on the first output only
    assert [t for o in out[11] for t in o.token_ids] == hf_greedy(model, with_prefix, 3)

    assert all(o.prompt_logprobs is None for o in out[12])
    assert [t for o in out[12] for t in o.token_ids] == hf_greedy(model, other, 3)

    [done] = out[13]
    assert done.finish_reason == 'length' and done.token_ids == ()
    check_prompt_logprobs(done.prompt_logprobs, shared, hf_logprobs(model, shared), 0)
    assert all(len(e) == 1 for e in done.prompt_logprobs[1:])

    # the requests that read their own prompt left the cache serving the others
    again = run(engine, [EngineRequest(14, tuple(shared), SamplingParams(max_new_tokens=1))])
    assert again[14][-1].num_cached_tokens >= 32


def test_one_token_prompt_and_a_stop_token_first(engine, tiny):
    """A one-token prompt has the one None entry; a request whose first token stops it still gets them."""
    model = tiny[0]
    out = run(engine, [EngineRequest(20, (7,), SamplingParams(max_new_tokens=0, prompt_logprobs=2))])
    assert out[20][0].prompt_logprobs == (None,) and out[20][0].finish_reason == 'length'
    ids = list(range(5, 25))
    want = hf_greedy(model, ids, 1)[0]
    out = run(engine, [EngineRequest(21, tuple(ids), SamplingParams(max_new_tokens=5, prompt_logprobs=1,
                                                                    stop_token_ids=(want,)))])
    [stop] = out[21]
    assert stop.finish_reason == 'stop' and stop.token_ids == ()
    check_prompt_logprobs(stop.prompt_logprobs, ids, hf_logprobs(model, ids), 1)


@pytest.mark.parametrize('backend', ['pytorch', 'turbomind'])
def test_prompt_logprobs_survive_preemption(backend, tiny):
    """A cache too small for both: the newer request is preempted and recomputed; its prompt logprobs
    are still HF's, each row read once."""
    model = tiny[0]
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, 512, (30,), generator=g).tolist()
    b = torch.randint(3, 512, (80,), generator=g).tolist()  # preempted mid-prefill: recomputed, rows read once
    ref_a, ref_b, greedy_b = hf_logprobs(model, a), hf_logprobs(model, b), hf_greedy(model, b, 8)
    with make_engine(backend, tiny[1], num_cache_blocks=12, session_len=96) as engine:
        # b meets a while a decodes unless this thread is held up between the two adds: try again then
        for attempt in range(5):
            sa, sb = 30 + 2 * attempt, 31 + 2 * attempt
            out = run(engine, [EngineRequest(sa, tuple(a), SamplingParams(max_new_tokens=60, prompt_logprobs=1)),
                               EngineRequest(sb, tuple(b), SamplingParams(max_new_tokens=8, prompt_logprobs=2))])
            check_prompt_logprobs(out[sa][0].prompt_logprobs, a, ref_a, 1)
            check_prompt_logprobs(out[sb][0].prompt_logprobs, b, ref_b, 2)
            assert [t for o in out[sb] for t in o.token_ids] == greedy_b
            if engine.stats().num_preemptions > 0:
                break
        assert engine.stats().num_preemptions > 0


def test_refused(engine):
    with pytest.raises(ValueError, match='prompt_logprobs'):
        engine.add_request(EngineRequest(40, (1, 2, 3), SamplingParams(prompt_logprobs=21)), lambda out: None)
    with pytest.raises(ValueError, match='sequence_start'):  # a kept session's history has no logits left
        engine.add_request(EngineRequest(41, (1, 2, 3), SamplingParams(prompt_logprobs=1), sequence_start=False),
                           lambda out: None)
    with pytest.raises(ValueError, match='prompt_logprobs'):
        GenerationConfig(prompt_logprobs=-1)
    assert SamplingParams.from_generation_config(GenerationConfig(prompt_logprobs=4)).prompt_logprobs == 4


def test_both_schedulers_skip_reading_the_prefix_cache_alike():
    """The C++ scheduler and its Python twin: a sequence with skip_reading_prefix_cache is admitted with
    nothing computed though its prompt's head is cached; one without the flag hits."""
    from lmd.pytorch_backend.block_manager import BlockManager
    from lmd.pytorch_backend.scheduler import Scheduler
    from lmd.pytorch_backend.sequence import Sequence
    from lmd.turbomind._turbomind import engine_parts as ep

    tokens = list(range(1, 30))
    twins = [(BlockManager, Scheduler, lambda sid: Sequence(sid, tokens, SamplingParams(), None, None)),
             (ep.BlockManager, ep.Scheduler, lambda sid: ep.Sequence(sid, tokens))]
    for block_manager, scheduler, sequence in twins:
        sched = scheduler(block_manager(16, 8, enable_prefix_caching=True), 4, 64)
        first = sequence(1)
        sched.add(first)
        sched.update(sched.schedule())
        sched.finish(first)  # its three full blocks stay cached
        skipping, hitting = sequence(2), sequence(3)
        skipping.skip_reading_prefix_cache = True
        sched.add(skipping)
        sched.add(hitting)
        out = sched.schedule()
        assert list(out.num_scheduled_tokens) == [29, 29 - 24]
        assert skipping.num_computed_tokens == 0 and hitting.num_computed_tokens == 24
