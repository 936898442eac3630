"""PytorchEngine end to end: logits and greedy tokens vs HF transformers (float32), batching,
prefix caching, preemption, interactive sessions, bad input and block accounting.

Tiny random models of every architecture give breadth; the real SmolLM2-135M a few
golden checks. Every engine runs the real path: scheduler, chunked prefill, paged
KV cache, decode steps.
"""
from __future__ import annotations

import copy
import os
import random
import threading

import pytest
import torch
import transformers

from lmd.engine import EngineOutput, EngineRequest, SamplingParams
from lmd.messages import PytorchEngineConfig
from lmd.pytorch_backend import PytorchEngine
from tiny_models import saved_models, tiny_hf_model

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)
ARCHS = {
    'llama': ('LlamaConfig', 'LlamaForCausalLM', dict(tie_word_embeddings=True)),
    'mistral': ('MistralConfig', 'MistralForCausalLM', dict(sliding_window=None)),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', dict()),
    'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM', dict(head_dim=24)),
}


# ---- fixtures and helpers ---------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def tiny_models(tmp_path_factory):
    """arch -> (HF model, saved dir); built once per module."""
    def make(arch: str):
        cfg_name, model_name, extra = ARCHS[arch]
        return tiny_hf_model(cfg_name, model_name, **TINY, **extra)
    return saved_models(tmp_path_factory, make)


def tiny_engine(tiny_models, arch='llama', **cfg) -> PytorchEngine:
    cfg.setdefault('cache_block_seq_len', 8)
    cfg.setdefault('num_cache_blocks', 256)
    cfg.setdefault('max_prefill_token_num', 48)
    return PytorchEngine(tiny_models(arch)[1], PytorchEngineConfig(**cfg))


class Collector:
    """Callbacks of many requests; ``wait`` until each has its final output."""

    def __init__(self):
        self.outputs: dict[int, list[EngineOutput]] = {}
        self._cond = threading.Condition()
        self.on_output = None

    def callback(self, out: EngineOutput):
        with self._cond:
            self.outputs.setdefault(out.session_id, []).append(out)
            self._cond.notify_all()
        if self.on_output is not None:
            self.on_output(out)

    def finished(self, sid) -> bool:
        outs = self.outputs.get(sid)
        return bool(outs) and outs[-1].finish_reason is not None

    def wait(self, sids, timeout=120):
        with self._cond:
            assert self._cond.wait_for(lambda: all(self.finished(s) for s in sids), timeout), \
                f'requests {[s for s in sids if not self.finished(s)]} did not finish'
        for sid in sids:
            assert sum(o.finish_reason is not None for o in self.outputs[sid]) == 1

    def tokens(self, sid) -> list[int]:
        return [t for o in self.outputs[sid] for t in o.token_ids]

    def final(self, sid) -> EngineOutput:
        return self.outputs[sid][-1]


def generate(engine, prompts, sampling=None, first_sid=0, timeout=300):
    """Submit all prompts at once; returns (token lists, final outputs)."""
    col = Collector()
    sids = []
    for i, p in enumerate(prompts):
        sp = sampling[i] if isinstance(sampling, list) else (sampling or SamplingParams(max_new_tokens=16))
        sid = first_sid + i
        engine.add_request(EngineRequest(sid, tuple(p), sp), col.callback)
        sids.append(sid)
    col.wait(sids, timeout)
    return [col.tokens(s) for s in sids], [col.final(s) for s in sids]


def assert_no_leak(engine):
    engine.check_invariants()
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0
    assert st.num_free_blocks + st.num_cached_blocks == st.num_total_blocks, st


def rand_prompt(rng, n, vocab=512):
    return [rng.randrange(vocab) for _ in range(n)]


@torch.no_grad()
def hf_logits(model, ids) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids, n) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# ---- tiny models: breadth --------------------------------------------------------------------------------

@pytest.mark.parametrize('arch', list(ARCHS))
def test_teacher_forced_logits_match_hf(tiny_models, arch):
    model, _ = tiny_models(arch)
    rng = random.Random(1)
    prompt, forced = rand_prompt(rng, 61), rand_prompt(rng, 16)
    # block 8, chunks of 24: the prompt prefills in 3 chunks that end mid-block, then 16 decode steps
    with tiny_engine(tiny_models, arch, max_prefill_token_num=24) as engine:
        got = engine.teacher_forced_logits(prompt, forced)
        assert_no_leak(engine)
    want = hf_logits(model, prompt + forced)[len(prompt) - 1:]
    assert got.shape == want.shape == (17, 512)
    assert (got - want).abs().max().item() < 1e-3


def test_greedy_matches_hf_and_batch_invariance(tiny_models):
    model, _ = tiny_models('llama')
    rng = random.Random(2)
    lengths = [3, 90, 17, 1, 40, 64, 8, 33, 120, 5, 71, 16, 2, 55, 9, 100]
    prompts = [rand_prompt(rng, n) for n in lengths]
    sp = SamplingParams(max_new_tokens=24)
    with tiny_engine(tiny_models, max_batch_size=16, max_prefill_token_num=96) as engine:
        together, finals = generate(engine, prompts, sp)
        alone = [generate(engine, [p], sp, first_sid=100 + i)[0][0] for i, p in enumerate(prompts)]
        assert_no_leak(engine)
    assert together == alone
    for p, toks, final in zip(prompts[:4], together, finals):
        assert toks == hf_greedy(model, p, 24)
        assert final.finish_reason == 'length' and final.num_prompt_tokens == len(p)


def test_seeded_sampling_alone_equals_in_batch(tiny_models):
    rng = random.Random(3)
    prompts = [rand_prompt(rng, n) for n in (12, 30, 7, 50)]
    sampled = SamplingParams(max_new_tokens=20, greedy=False, temperature=1.0, top_p=0.95, random_seed=1234)
    sps = [sampled, SamplingParams(max_new_tokens=20), sampled, SamplingParams(max_new_tokens=20)]
    with tiny_engine(tiny_models) as engine:
        alone = generate(engine, [prompts[0]], sampled)[0][0]
        together = generate(engine, prompts, sps, first_sid=10)[0]
        again = generate(engine, [prompts[0]], sampled, first_sid=20)[0][0]
    assert alone == together[0] == again
    assert together[2] != alone  # a different prompt under the same seed draws a different stream


def test_prefix_cache_hit_gives_same_output_as_miss(tiny_models):
    rng = random.Random(4)
    prefix = rand_prompt(rng, 200)
    a, b = prefix + rand_prompt(rng, 11), prefix + rand_prompt(rng, 23)
    sp = SamplingParams(max_new_tokens=12)
    with tiny_engine(tiny_models, enable_prefix_caching=False) as engine:
        want_a, want_b = generate(engine, [a, b], sp)[0]
    with tiny_engine(tiny_models, cache_block_seq_len=16, enable_prefix_caching=True) as engine:
        got_a = generate(engine, [a], sp)[0][0]
        (got_b,), (final_b,) = generate(engine, [b], sp, first_sid=1)
        st = engine.stats()
        assert st.num_prefix_hit_tokens >= 192 and final_b.num_cached_tokens >= 192
        # the whole of a is cached now: asking again recomputes only its last block
        (got_a2,), (final_a2,) = generate(engine, [a], sp, first_sid=2)
        assert final_a2.num_cached_tokens >= 192
        assert_no_leak(engine)
    assert got_a == want_a == got_a2 and got_b == want_b


def test_preemption_by_recompute(tiny_models):
    rng = random.Random(5)
    prompts = [rand_prompt(rng, rng.randrange(10, 40)) for _ in range(8)]
    sp = SamplingParams(max_new_tokens=40)
    with tiny_engine(tiny_models) as engine:
        want = generate(engine, prompts, sp)[0]
    # 8 requests of up to 80 tokens need ~80 blocks of 8; give them 24
    with tiny_engine(tiny_models, num_cache_blocks=24, session_len=192) as engine:
        got, finals = generate(engine, prompts, sp)
        assert engine.stats().num_preemptions > 0
        assert_no_leak(engine)
    assert got == want
    assert all(f.finish_reason == 'length' for f in finals)


def test_block_accounting_with_aborts_and_preemption(tiny_models):
    rng = random.Random(6)
    prefix = rand_prompt(rng, 40)
    prompts = [(prefix if i % 2 else []) + rand_prompt(rng, rng.randrange(1, 30)) for i in range(12)]
    with tiny_engine(tiny_models, num_cache_blocks=30, session_len=240, enable_prefix_caching=True,
                     max_batch_size=6) as engine:
        col = Collector()

        def abort_some(out):  # runs on the engine thread, as an impatient client would
            if out.session_id % 3 == 0 and out.finish_reason is None and len(col.outputs[out.session_id]) == 5:
                engine.abort(out.session_id)
        col.on_output = abort_some
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(i, tuple(p), SamplingParams(max_new_tokens=30)), col.callback)
        engine.abort(11)  # possibly before it ever ran
        engine.check_invariants()
        col.wait(range(12))
        reasons = [col.final(i).finish_reason for i in range(12)]
        assert reasons.count('abort') >= 4 and reasons.count('length') >= 6
        assert all(len(col.tokens(i)) == 30 for i in range(12) if reasons[i] == 'length')
        assert engine.stats().num_preemptions > 0
        assert_no_leak(engine)
        assert engine.stats().num_cached_blocks > 0  # the shared prefix stays reusable


def test_interactive_session_reuses_kept_cache(tiny_models):
    rng = random.Random(7)
    p1, p2 = rand_prompt(rng, 37), rand_prompt(rng, 13)
    sp = SamplingParams(max_new_tokens=10)
    with tiny_engine(tiny_models) as engine:
        col = Collector()
        engine.add_request(EngineRequest(5, tuple(p1), sp, sequence_start=True, sequence_end=False), col.callback)
        col.wait([5])
        o1 = col.tokens(5)
        assert engine.stats().num_free_blocks < engine.stats().num_total_blocks  # the session keeps its blocks
        col.outputs.clear()
        engine.add_request(EngineRequest(5, tuple(p2), sp, sequence_start=False, sequence_end=True), col.callback)
        col.wait([5])
        o2, final = col.tokens(5), col.final(5)
        assert final.num_prompt_tokens == len(p1) + len(o1) + len(p2)
        assert final.num_cached_tokens >= len(p1) + len(o1) - 1  # all of turn 1 but its last, uncomputed token
        assert_no_leak(engine)
        single = generate(engine, [p1 + o1 + p2], sp, first_sid=6)[0][0]
    assert o2 == single


def test_interactive_session_end_and_eviction(tiny_models):
    rng = random.Random(8)
    sp = SamplingParams(max_new_tokens=4)
    with tiny_engine(tiny_models, num_cache_blocks=16, session_len=128) as engine:
        col = Collector()
        p1 = rand_prompt(rng, 60)
        engine.add_request(EngineRequest(1, tuple(p1), sp, sequence_end=False), col.callback)
        col.wait([1])
        o1 = col.tokens(1)
        # a request needing most of the cache pushes the idle session's blocks out
        big = generate(engine, [rand_prompt(rng, 100)], sp, first_sid=2)[1][0]
        assert big.finish_reason == 'length'
        col.outputs.clear()
        p2 = rand_prompt(rng, 5)
        engine.add_request(EngineRequest(1, tuple(p2), sp, sequence_start=False, sequence_end=False), col.callback)
        col.wait([1])
        assert col.final(1).num_cached_tokens == 0  # recomputed, with the same result as a single shot
        assert col.tokens(1) == generate(engine, [p1 + o1 + p2], sp, first_sid=3)[0][0]
        engine.end(1)
        with pytest.raises(ValueError, match='unknown'):
            engine.add_request(EngineRequest(1, (1, 2), sp, sequence_start=False), col.callback)
        assert_no_leak(engine)


def test_bad_input_raises_and_engine_keeps_serving(tiny_models):
    sp = SamplingParams(max_new_tokens=4)
    with tiny_engine(tiny_models, session_len=64) as engine:
        cb = Collector().callback
        with pytest.raises(ValueError, match='session_len'):
            engine.add_request(EngineRequest(1, tuple(range(64)), sp), cb)
        with pytest.raises(ValueError, match='empty'):
            engine.add_request(EngineRequest(1, (), sp), cb)
        with pytest.raises(ValueError, match='vocabulary'):
            engine.add_request(EngineRequest(1, (1, 512), sp), cb)
        with pytest.raises(ValueError, match='vocabulary'):
            engine.add_request(EngineRequest(1, (-1, 3), sp), cb)
        with pytest.raises(ValueError, match='unknown'):
            engine.add_request(EngineRequest(1, (1, 2), sp, sequence_start=False), cb)
        col = Collector()
        engine.add_request(EngineRequest(1, (1, 2, 3), SamplingParams(max_new_tokens=200)), col.callback)
        with pytest.raises(ValueError, match='in flight'):
            engine.add_request(EngineRequest(1, (1, 2, 3), sp), cb)
        col.wait([1])
        assert col.final(1).finish_reason == 'length' and len(col.tokens(1)) == 64 - 3  # capped by session_len
        toks, finals = generate(engine, [(4, 5, 6)], sp, first_sid=1)
        assert finals[0].finish_reason == 'length' and len(toks[0]) == 4
        assert_no_leak(engine)


def test_stop_tokens_abort_and_zero_new_tokens(tiny_models):
    rng = random.Random(9)
    prompt = rand_prompt(rng, 20)
    with tiny_engine(tiny_models) as engine:
        full = generate(engine, [prompt], SamplingParams(max_new_tokens=20))[0][0]
        stop = full[6]
        cut = full[:full.index(stop)]
        toks, finals = generate(engine, [prompt], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)), 1)
        assert toks[0] == cut and finals[0].finish_reason == 'stop'  # the stop token is not output
        toks, finals = generate(engine, [prompt], SamplingParams(max_new_tokens=0), 2)
        assert toks[0] == [] and finals[0].finish_reason == 'length'
        col = Collector()
        engine.add_request(EngineRequest(4, tuple(prompt), SamplingParams(max_new_tokens=5, logprobs=2)),
                           col.callback)
        col.wait([4])
        assert col.tokens(4) == full[:5]
        for out in col.outputs[4]:
            for tok, lp in zip(out.token_ids, out.logprobs):
                assert tok in lp and lp[tok] <= 0.0 and len(lp) >= 2
        col = Collector()
        col.on_output = lambda out: engine.abort(3) if out.finish_reason is None else None
        engine.add_request(EngineRequest(3, tuple(prompt), SamplingParams(max_new_tokens=500)), col.callback)
        col.wait([3])
        assert col.final(3).finish_reason == 'abort' and len(col.tokens(3)) < 500
        engine.abort(12345)  # unknown ids are ignored
        assert_no_leak(engine)


def test_failed_step_fails_its_requests_and_engine_keeps_serving(tiny_models):
    with tiny_engine(tiny_models) as engine:
        model = engine.runner.model
        real_forward = model.forward

        def broken(*args, **kwargs):
            model.forward = real_forward
            raise RuntimeError('simulated kernel failure')
        model.forward = broken
        toks, finals = generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=4))
        assert finals[0].finish_reason == 'error' and 'simulated kernel failure' in finals[0].error
        toks, finals = generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=4), first_sid=1)
        assert finals[0].finish_reason == 'length' and len(toks[0]) == 4
        assert_no_leak(engine)


def test_close_aborts_pending_requests(tiny_models):
    engine = tiny_engine(tiny_models)
    col = Collector()
    for i in range(3):
        engine.add_request(EngineRequest(i, (1, 2, 3), SamplingParams(max_new_tokens=100000)), col.callback)
    engine.close()
    col.wait(range(3), timeout=10)
    assert all(col.final(i).finish_reason == 'abort' for i in range(3))
    with pytest.raises(RuntimeError, match='closed'):
        engine.add_request(EngineRequest(9, (1,), SamplingParams()), col.callback)


def test_engine_thread_leaves_the_cores_to_the_kernel_pool(tiny_models):
    """With the kernel library's kernels on the CPU, torch's own ops on the engine thread run inline (an
    OpenMP team of torch's would take the pool's cores); the building thread's count and the count later
    threads take stay as they were."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip('torch runs one thread here: nothing to leave')
    with tiny_engine(tiny_models) as engine:
        assert engine.runner.model.kernels.name == 'native'
        assert engine.call_on_engine_thread(lambda e: torch.get_num_threads()) == 1
        assert torch.get_num_threads() == threads
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [threads]
        toks, finals = generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=3))
        assert len(toks[0]) == 3


def test_cache_sizing_and_dtype(tiny_models, tmp_path):
    model, _ = tiny_models('llama')
    # sized from memory: a 64 KiB cap holds fewer blocks than one session needs, so it gets that many
    engine = PytorchEngine(tiny_models('llama')[1], PytorchEngineConfig(
        cache_block_seq_len=16, session_len=256, max_cache_memory_gib=64 / 2**20))
    try:
        assert engine.stats().num_total_blocks == 256 // 16 and engine.model_info.session_len == 256
        assert engine.dtype == torch.float32 and engine.model_info.vocab_size == 512
    finally:
        engine.close()
    # an explicit cache smaller than session_len cuts session_len to what fits
    with tiny_engine(tiny_models, num_cache_blocks=4, session_len=1000) as engine:
        assert engine.model_info.session_len == 32
    # 'auto' keeps the checkpoint's dtype; an explicit one wins
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(tmp_path), safe_serialization=True)
    with PytorchEngine(str(tmp_path), PytorchEngineConfig(num_cache_blocks=8, cache_block_seq_len=8)) as engine:
        assert engine.dtype == torch.bfloat16
        toks, finals = generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=3))
        assert finals[0].finish_reason == 'length' and len(toks[0]) == 3
    with PytorchEngine(str(tmp_path), PytorchEngineConfig(num_cache_blocks=8, cache_block_seq_len=8,
                                                          dtype='float32')) as engine:
        assert engine.dtype == torch.float32
    with PytorchEngine(str(tmp_path), PytorchEngineConfig(num_cache_blocks=8, quant_policy=8)) as engine:
        assert engine.runner.kv_caches[0][0].dtype == torch.uint8  # more in tests/test_pytorch_quant.py
        assert len(generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=3))[0][0]) == 3


# ---- the real SmolLM2-135M ------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def smol(smollm2_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(smollm2_dir, 'tokenizer.json'))
    engine = PytorchEngine(smollm2_dir, PytorchEngineConfig(
        session_len=2048, cache_block_seq_len=16, num_cache_blocks=256, max_prefill_token_num=64,
        enable_prefix_caching=True))
    yield hf, tok, engine
    engine.close()


SMOL_PROMPTS = [
    'The history of the printing press begins',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'Here is a list of the planets of the solar system, in order from the sun:\n1.',
    'Once upon a time, in a small village by the sea, there lived',
]


def test_smollm2_teacher_forced_logits(smol):
    hf, tok, engine = smol
    ids = tok.encode(SMOL_PROMPTS[0] + ' in the fifteenth century, when Johannes Gutenberg, a goldsmith from '
                     'Mainz, combined movable metal type with an oil-based ink and a screw press.').ids
    prompt, forced = ids[:-16], ids[-16:]
    got = engine.teacher_forced_logits(prompt, forced)
    want = hf_logits(hf, ids)[len(prompt) - 1:]
    assert (got - want).abs().max().item() < 1e-3


def test_smollm2_greedy_matches_hf_generate(smol):
    hf, tok, engine = smol
    prompts = [tok.encode(p).ids for p in SMOL_PROMPTS]
    got, finals = generate(engine, prompts, SamplingParams(max_new_tokens=32), first_sid=1000)
    for p, toks in zip(prompts, got):
        assert len(toks) == 32
        assert toks == hf_greedy(hf, p, 32)
    engine.check_invariants()


def test_smollm2_prefix_cache_hit(smol):
    hf, tok, engine = smol
    text = ' '.join(SMOL_PROMPTS) * 4
    prefix = tok.encode(text).ids[:200]
    a = prefix + tok.encode(' The first question is').ids
    b = prefix + tok.encode(' Summarize the text above.').ids
    sp = SamplingParams(max_new_tokens=8)
    before = engine.stats().num_prefix_hit_tokens
    generate(engine, [a], sp, first_sid=2000)
    (got_b,), (final_b,) = generate(engine, [b], sp, first_sid=2001)
    assert engine.stats().num_prefix_hit_tokens - before >= 192 and final_b.num_cached_tokens >= 192
    assert got_b == hf_greedy(hf, b, 8)
    engine.check_invariants()


def test_cuda_kernel_backend_errors():
    """The 'cuda' kernels (lmd.kernels.cuda) on the wrong device or in a build without them: a clear
    error when the model is built, naming what to do (tests/test_gpu.py runs them on a GPU)."""
    import lmd.kernels
    from lmd.pytorch_backend.kernels import BACKENDS, get_kernels
    assert 'cuda' in BACKENDS
    with pytest.raises(ValueError, match="kernel backend 'cuda' runs lmd's CUDA kernels on a CUDA device, not on cpu"):
        get_kernels('cpu', 'cuda')
    with pytest.raises(ValueError, match="runs on cuda:0 for now, not on cuda:1.*CUDA_VISIBLE_DEVICES=1"):
        get_kernels('cuda:1', 'cuda')
    if lmd.kernels.cuda is None:
        with pytest.raises(RuntimeError, match=r"needs lmd built with its CUDA kernels .*"
                                               r"pip install \. -C cmake\.define\.LMD_WITH_CUDA=ON"):
            get_kernels('cuda', 'cuda')
    else:
        assert get_kernels('cuda', 'cuda').name == 'cuda'
