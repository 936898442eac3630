"""TurboMind's engine (C++ thread, block manager, prefix cache, sampler) through lmd's
Engine interface: tiny random models of each architecture for breadth, SmolLM2 end to
end, the same checks as the PyTorch engine's."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from lmd.engine import EngineRequest, SamplingParams
from lmd.messages import TurbomindEngineConfig
from lmd.turbomind.engine import TurbomindEngine
from test_pytorch_engine import (ARCHS, SMOL_PROMPTS, Collector, generate, hf_greedy, rand_prompt,  # noqa: F401
                                 tiny_models)


def tm_engine(tiny_models, arch='llama', **cfg) -> TurbomindEngine:
    cfg.setdefault('cache_block_seq_len', 8)
    cfg.setdefault('num_cache_blocks', 256)
    cfg.setdefault('max_prefill_token_num', 48)
    return TurbomindEngine(tiny_models(arch)[1], TurbomindEngineConfig(**cfg))


def assert_all_blocks_back(engine):
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0, st
    assert st.num_free_blocks + st.num_cached_blocks == st.num_total_blocks, st


@pytest.mark.parametrize('arch', list(ARCHS))
def test_greedy_matches_hf(tiny_models, arch):
    model, _ = tiny_models(arch)
    rng = random.Random(1)
    prompts = [rand_prompt(rng, n) for n in (5, 60, 17)]
    with tm_engine(tiny_models, arch) as engine:
        got, finals = generate(engine, prompts, SamplingParams(max_new_tokens=24))
        assert_all_blocks_back(engine)
    for p, toks, final in zip(prompts, got, finals):
        assert toks == hf_greedy(model, p, 24)
        assert final.finish_reason == 'length' and final.num_prompt_tokens == len(p)


def test_batch_invariance_and_seeded_sampling(tiny_models):
    rng = random.Random(2)
    lengths = [3, 90, 17, 1, 40, 64, 8, 33, 120, 5, 71, 16, 2, 55, 9, 100]
    prompts = [rand_prompt(rng, n) for n in lengths]
    greedy = SamplingParams(max_new_tokens=24)
    seeded = SamplingParams(max_new_tokens=20, greedy=False, temperature=1.0, top_p=0.95, random_seed=1234)
    sampling = [seeded if i % 3 == 0 else greedy for i in range(len(prompts))]
    with tm_engine(tiny_models, max_batch_size=16, max_prefill_token_num=96) as engine:
        together, _ = generate(engine, prompts, sampling)
        alone = [generate(engine, [p], [sampling[i]], first_sid=100 + i)[0][0] for i, p in enumerate(prompts)]
        assert_all_blocks_back(engine)
    assert together == alone


def test_prefix_cache_hit_gives_same_output(tiny_models):
    rng = random.Random(3)
    prefix = rand_prompt(rng, 200)
    a, b = prefix + rand_prompt(rng, 7), prefix + rand_prompt(rng, 9)
    sp = SamplingParams(max_new_tokens=12)
    with tm_engine(tiny_models, enable_prefix_caching=False) as cold:
        (want_b,), _ = generate(cold, [b], sp)
    with tm_engine(tiny_models, enable_prefix_caching=True) as engine:
        generate(engine, [a], sp)
        (got_b,), (final_b,) = generate(engine, [b], sp, first_sid=1)
        st = engine.stats()
        assert_all_blocks_back(engine)
    assert got_b == want_b
    assert final_b.num_cached_tokens == 200 // 8 * 8
    assert st.num_prefix_hit_tokens >= 200 // 8 * 8


def test_preemption_gives_same_tokens(tiny_models):
    rng = random.Random(4)
    prompts = [rand_prompt(rng, n) for n in (30, 45, 20, 38)]
    sp = SamplingParams(max_new_tokens=40)
    with tm_engine(tiny_models) as ample:
        want, _ = generate(ample, prompts, sp)
    # 24 blocks of 8 tokens: less than the four sequences need together (4 x ~10 blocks)
    with tm_engine(tiny_models, num_cache_blocks=24, session_len=128) as small:
        got, finals = generate(small, prompts, sp)
        assert small.stats().num_preemptions > 0
        assert_all_blocks_back(small)
    assert got == want
    assert all(f.finish_reason == 'length' for f in finals)


def test_aborts_and_preemption_return_every_block(tiny_models):
    rng = random.Random(5)
    with tm_engine(tiny_models, num_cache_blocks=30, session_len=200, enable_prefix_caching=True) as engine:
        col = Collector()
        aborted = set()

        def maybe_abort(out):
            if out.session_id % 2 == 0 and out.finish_reason is None and out.session_id not in aborted:
                aborted.add(out.session_id)
                engine.abort(out.session_id)
        col.on_output = maybe_abort
        sids = list(range(12))
        for i in sids:
            engine.add_request(EngineRequest(i, tuple(rand_prompt(rng, 20 + 5 * i)), SamplingParams(max_new_tokens=30)),
                               col.callback)
        col.wait(sids)
        assert {col.final(i).finish_reason for i in sids if i % 2 == 0} <= {'abort', 'length'}
        assert all(col.final(i).finish_reason == 'length' for i in sids if i % 2 == 1)
        assert_all_blocks_back(engine)


def test_interactive_session_keeps_its_cache(tiny_models):
    rng = random.Random(6)
    turn1, turn2 = rand_prompt(rng, 20), rand_prompt(rng, 6)
    sp = SamplingParams(max_new_tokens=10)
    with tm_engine(tiny_models) as engine:
        col = Collector()
        engine.add_request(EngineRequest(7, tuple(turn1), sp, sequence_end=False), col.callback)
        col.wait([7])
        first = col.tokens(7)
        col2 = Collector()
        engine.add_request(EngineRequest(7, tuple(turn2), sp, sequence_start=False), col2.callback)
        col2.wait([7])
        final = col2.final(7)
        assert final.num_prompt_tokens == len(turn1) + len(first) + len(turn2)
        assert final.num_cached_tokens == len(turn1) + len(first) - 1  # all but the last answer token
        (one_shot,), _ = generate(engine, [turn1 + first + turn2], sp, first_sid=8)
        assert col2.tokens(7) == one_shot
        with pytest.raises(ValueError, match='unknown'):
            engine.add_request(EngineRequest(7, (1,), sp, sequence_start=False), Collector().callback)
        assert_all_blocks_back(engine)


def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(tiny_models):
    sp = SamplingParams(max_new_tokens=4)
    with tm_engine(tiny_models, session_len=64) as engine:
        with pytest.raises(ValueError, match='empty'):
            engine.add_request(EngineRequest(1, (), sp), Collector().callback)
        with pytest.raises(ValueError, match='outside the vocabulary'):
            engine.add_request(EngineRequest(1, (1, 512), sp), Collector().callback)
        with pytest.raises(ValueError, match='session_len=64'):
            engine.add_request(EngineRequest(1, tuple(range(64)), sp), Collector().callback)
        with pytest.raises(ValueError, match='top_p'):
            engine.add_request(EngineRequest(1, (1, 2), SamplingParams(greedy=False, top_p=0.0)), Collector().callback)
        got, finals = generate(engine, [[1, 2, 3]], sp, first_sid=1)
        assert len(got[0]) == 4 and finals[0].finish_reason == 'length'
        assert_all_blocks_back(engine)


def test_stop_tokens_zero_new_tokens_logprobs_and_close(tiny_models):
    rng = random.Random(8)
    prompt = rand_prompt(rng, 12)
    with tm_engine(tiny_models) as engine:
        full = generate(engine, [prompt], SamplingParams(max_new_tokens=20))[0][0]
        stop = full[5]
        toks, finals = generate(engine, [prompt], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)), 1)
        assert toks[0] == full[:full.index(stop)] and finals[0].finish_reason == 'stop'
        toks, finals = generate(engine, [prompt], SamplingParams(max_new_tokens=0), 2)
        assert toks[0] == [] and finals[0].finish_reason == 'length'
        col = Collector()
        engine.add_request(EngineRequest(3, tuple(prompt), SamplingParams(max_new_tokens=3, logprobs=2)), col.callback)
        col.wait([3])
        lps = [lp for o in col.outputs[3] for lp in (o.logprobs or ())]
        assert len(lps) == 3 and all(len(d) >= 2 and all(v <= 0 for v in d.values()) for d in lps)
        col = Collector()
        for i in range(4):
            engine.add_request(EngineRequest(10 + i, tuple(prompt), SamplingParams(max_new_tokens=100000)),
                               col.callback)
    col.wait(range(10, 14))
    assert {col.final(i).finish_reason for i in range(10, 14)} == {'abort'}


def test_smollm2_through_the_pipeline(smollm2_dir):
    """SmolLM2 end to end: greedy tokens equal HF's for 32 tokens on several prompts, and 64
    concurrent streams through the Python API finish, half of them aborted mid-stream."""
    import asyncio

    import transformers

    from lmd import GenerationConfig, pipeline
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    pipe = pipeline(smollm2_dir, backend_config=TurbomindEngineConfig(num_cache_blocks=160, cache_block_seq_len=64))
    try:
        tok = pipe.async_engine.tokenizer
        engine = pipe.async_engine.engine
        assert engine.model.num_w4a16 > 0  # the GGUF's 4-bit matmuls run as they are
        prompts = [tok.encode(p) for p in SMOL_PROMPTS]
        got, _ = generate(engine, prompts, SamplingParams(max_new_tokens=32), first_sid=10_000)
        for p, toks in zip(prompts, got):
            assert toks == hf_greedy(hf, p, 32)

        async def stream(i):
            gen = GenerationConfig(max_new_tokens=24 if i % 2 else 200, ignore_eos=True)
            n = 0
            async for _ in pipe.async_engine.generate(f'Tell me fact number {i} about rivers.', gen_config=gen):
                n += 1
                if i % 2 == 0 and n == 3:
                    break  # the consumer leaves: the request is aborted
            return n

        async def run_all():
            return await asyncio.gather(*(stream(i) for i in range(64)))
        counts = pipe._run(run_all())
        assert all(c >= 3 for c in counts)
        deadline = threading.Event()
        for _ in range(100):  # aborts land on the engine thread shortly after the consumers leave
            st = engine.stats()
            if st.num_running == 0 and st.num_waiting == 0:
                break
            deadline.wait(0.1)
        assert_all_blocks_back(engine)
    finally:
        pipe.close()
