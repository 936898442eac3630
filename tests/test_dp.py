"""Data-parallel replicas (``--dp``, ``lmd.dp_engine``) and prefix-aware routing (``lmd.prefix_router``,
the proxy's ``prefix_aware``): the router's rule without engines; on both engines, two replicas of a tiny
random model give a single engine's greedy tokens, a shared-prefix workload hits the prefix caches more
with prefix-aware routing than round robin, sessions stay on their replica, adapters and scoring work
through it; SmolLM2 end to end through ``pipeline``; the proxy in front of two real api_servers sends a
prefix to the node that holds it. One thread per replica."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from lmd.async_engine import build_engine
from lmd.dp_engine import DataParallelEngine, replica_configs
from lmd.engine import EngineRequest, SamplingParams
from lmd.messages import EngineConfig, PytorchEngineConfig, TurbomindEngineConfig
from lmd.prefix_router import PrefixRouter, chunk_keys
from lmd.pytorch_backend import PytorchEngine
from lmd.turbomind.engine import TurbomindEngine
from test_pytorch_engine import Collector, generate, rand_prompt, tiny_models  # noqa: F401

CONFIGS = {'turbomind': TurbomindEngineConfig, 'pytorch': PytorchEngineConfig}
BLOCK = 8


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Replicas set torch's thread count process-wide (one each here): the tests after these get theirs back."""
    import torch
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def engine(tiny_models, backend, dp=2, routing=None, **cfg):
    """``dp`` replicas of the tiny Llama on ``backend``, one thread each, as ``build_engine`` makes them
    (``routing``: another routing than its default); dp 1: one engine of one thread."""
    cfg = dict(cache_block_seq_len=BLOCK, num_cache_blocks=128, max_prefill_token_num=64, num_threads=dp, **cfg)
    config = CONFIGS[backend](dp=dp, **cfg)
    model_dir = tiny_models('llama')[1]
    if routing is None:
        return build_engine(model_dir, backend, config)
    cls = {'turbomind': TurbomindEngine, 'pytorch': PytorchEngine}[backend]
    return DataParallelEngine(replica_configs(config), lambda c: cls(model_dir, c), routing=routing, seed=0)


# ---- the router's rule, without engines ------------------------------------------------------------------

def test_router_longest_prefix_then_load_then_room():
    router = PrefixRouter(chunk_size=4, capacity=100)
    a, b = list(range(20)), [99] + list(range(19))
    assert chunk_keys(a, 4)[:2] == router.keys(a[:9])[:2] and len(router.keys(a[:7])) == 1  # whole chunks only
    assert router.choose(['r0', 'r1'], [0, 0], router.keys(a)) == 'r0'  # a tie: the first
    assert router.choose(['r0', 'r1'], [0, 0], router.keys(b)) == 'r1'  # nothing held: the smaller record
    assert router.choose(['r0', 'r1'], [3, 0], router.keys(a[:12] + [7] * 8)) == 'r0'  # 3 chunks held there
    assert router.matched(router.keys(a)) == {'r0': 5}
    assert router.matched(router.keys(a, salt='adapter')) == {}  # another adapter's cache holds nothing of it
    assert router.choose(['r0', 'r1'], [5, 2], router.keys(a)) == 'r0'  # within the thresholds: locality
    # out of balance (10 more requests, > 1.5x): the least loaded, whatever it holds; it then holds it too
    assert router.choose(['r0', 'r1'], [12, 2], router.keys(a)) == 'r1'
    assert router.matched(router.keys(a)) == {'r0': 5, 'r1': 5}
    router.forget('r0')
    assert router.matched(router.keys(a)) == {'r1': 5}


def test_router_evicts_least_recent_keeping_shared_prefixes():
    router = PrefixRouter(chunk_size=2, capacity=6)
    shared = [1, 2, 3, 4]
    router.record('r', router.keys(shared + [5, 6, 7, 8]))  # 4 chunks
    router.record('r', router.keys(shared + [9, 9, 9, 9]))  # 2 more: 6
    router.record('r', router.keys([0, 0, 0, 0]))  # 2 more: the first prompt's tail goes, deepest first
    assert router.record_size('r') == 6
    assert router.matched(router.keys(shared + [5, 6, 7, 8])) == {'r': 2}
    assert router.matched(router.keys(shared + [9, 9, 9, 9])) == {'r': 4}


def test_replica_configs_share_the_threads():
    configs = replica_configs(EngineConfig(dp=2, num_threads=2, session_len=64))
    assert [(c.dp, c.num_threads, c.session_len) for c in configs] == [(1, 1, 64)] * 2
    assert [c.num_threads for c in replica_configs(EngineConfig(dp=3, num_threads=8))] == [2, 2, 2]
    assert [c.num_threads for c in replica_configs(EngineConfig(dp=4), cpu_count=2)] == [1] * 4  # at least one
    configs = replica_configs(PytorchEngineConfig(dp=2, tp=2, num_threads=8))  # an engine's count is per rank
    assert [(type(c), c.num_threads, c.tp) for c in configs] == [(PytorchEngineConfig, 2, 2)] * 2


# ---- two replicas of a tiny model, on each engine ----------------------------------------------------------

@pytest.mark.parametrize('backend', ['turbomind', 'pytorch'])
def test_dp2_gives_a_single_engines_tokens(tiny_models, backend):
    rng = random.Random(5)
    prompts = [rand_prompt(rng, n) for n in (5, 40, 17, 3, 66, 24, 9, 31)]
    sampling = SamplingParams(max_new_tokens=12)
    with engine(tiny_models, backend, dp=1) as single:
        expected, _ = generate(single, prompts, sampling)
    with engine(tiny_models, backend, enable_prefix_caching=True) as dp:
        assert isinstance(dp, DataParallelEngine) and len(dp.replicas) == 2
        got, finals = generate(dp, prompts, sampling)  # all at once: spread by load
        assert got == expected and all(f.finish_reason == 'length' for f in finals)
        each = dp.replica_stats()
        assert all(s.num_prompt_tokens > 0 for s in each), each  # both replicas served
        total = dp.stats()
        assert total.num_prompt_tokens == sum(len(p) for p in prompts) == sum(s.num_prompt_tokens for s in each)
        assert total.num_total_blocks == 2 * 128 and total.num_running == 0
        assert dp.model_info == single.model_info


def shared_prefix_workload(rng, groups=3, per_group=4, prefix_blocks=4):
    """``groups`` long prefixes, each followed by ``per_group`` short questions, interleaved group by group
    (A1 B1 C1 A2 B2 ...): what round robin scatters."""
    prefixes = [rand_prompt(rng, prefix_blocks * BLOCK) for _ in range(groups)]
    return [(g, prefixes[g] + rand_prompt(rng, 5)) for _ in range(per_group) for g in range(groups)]


@pytest.mark.parametrize('backend', ['turbomind', 'pytorch'])
def test_prefix_aware_routing_hits_the_cache_more_than_round_robin(tiny_models, backend):
    workload = shared_prefix_workload(random.Random(6))
    hits, where = {}, {}
    for routing in ('prefix_aware', 'round_robin'):
        with engine(tiny_models, backend, routing=routing, enable_prefix_caching=True) as dp:
            replicas = []
            for sid, (group, prompt) in enumerate(workload):  # one at a time: each sees the caches the last left
                generate(dp, [prompt], SamplingParams(max_new_tokens=2), first_sid=sid)
                replicas.append(dp.replica_stats())
            hits[routing] = [s.num_prefix_hit_tokens for s in dp.replica_stats()]
            where[routing] = replicas
    # prefix-aware: every prompt after its group's first finds its 4-block prefix on its replica
    assert sum(hits['prefix_aware']) == 3 * 3 * 4 * BLOCK, hits
    assert sum(hits['prefix_aware']) > sum(hits['round_robin']), hits
    assert all(h > 0 for h in hits['prefix_aware'])  # the groups spread over both replicas
    # the replica that holds a group's prefix is the one whose hit counter grew for that group's requests
    groups = {}
    for i, (group, _) in enumerate(workload):
        before = where['prefix_aware'][i - 1] if i else [None, None]
        grew = [k for k, (s, b) in enumerate(zip(where['prefix_aware'][i], before))
                if b is not None and s.num_prefix_hit_tokens > b.num_prefix_hit_tokens]
        if grew:
            groups.setdefault(group, set()).update(grew)
    assert len(groups) == 3 and all(len(r) == 1 for r in groups.values()), groups


@pytest.mark.parametrize('backend', ['turbomind', 'pytorch'])
def test_sessions_stay_on_their_replica(tiny_models, backend):
    rng = random.Random(7)
    sp = SamplingParams(max_new_tokens=3)
    with engine(tiny_models, backend) as dp:
        col = Collector()
        for sid in (1, 2, 3, 4):  # four interactive sessions at once: both replicas get some
            dp.add_request(EngineRequest(sid, tuple(rand_prompt(rng, 10)), sp, sequence_end=False), col.callback)
        col.wait([1, 2, 3, 4])
        home = {sid: dp.replica_of(sid) for sid in (1, 2, 3, 4)}
        assert set(home.values()) == {0, 1}, home
        for turn in range(3):  # later turns bring their new tokens only: the replica that keeps the cache
            col = Collector()
            for sid in home:
                dp.add_request(EngineRequest(sid, tuple(rand_prompt(rng, 4)), sp, sequence_start=False,
                                             sequence_end=False), col.callback)
            col.wait(list(home))
            assert all(col.final(s).finish_reason == 'length' for s in home)
            assert all(col.final(s).num_cached_tokens >= 10 for s in home)  # its kept history
            assert {sid: dp.replica_of(sid) for sid in home} == home
        # abort reaches the turn on its replica; end frees the session there
        col = Collector()
        dp.add_request(EngineRequest(1, (5,) * 4, SamplingParams(max_new_tokens=400), sequence_start=False,
                                     sequence_end=False), col.callback)
        dp.abort(1)
        col.wait([1])
        assert col.final(1).finish_reason == 'abort' and dp.replica_of(1) == home[1]
        dp.end(1)
        assert dp.replica_of(1) is None
        with pytest.raises(ValueError, match='session 1 is unknown'):
            dp.add_request(EngineRequest(1, (5,), sp, sequence_start=False), col.callback)
        for sid in (2, 3, 4):
            dp.end(sid)
        deadline = time.monotonic() + 10  # an end is handled on its replica's engine thread, soon
        while (st := dp.stats()).num_free_blocks + st.num_cached_blocks < st.num_total_blocks:
            assert time.monotonic() < deadline, f'the ended sessions\' blocks did not come back: {st}'
            time.sleep(0.01)
        assert st.num_running == st.num_waiting == 0


@pytest.mark.parametrize('backend', ['turbomind', 'pytorch'])
def test_adapters_scoring_and_speculative_config_reach_every_replica(tiny_models, tmp_path, backend):
    from lmd.lora import load_lora_adapter
    from lmd.messages import SpeculativeConfig
    from lmd.model_config import ModelConfig
    from lora_utils import make_adapter
    import torch
    model, model_dir = tiny_models('llama')
    path = make_adapter(model, str(tmp_path / 'attn'), seed=3, r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'])
    adapter = load_lora_adapter(path, ModelConfig.from_dir(model_dir), 'attn')
    ids = rand_prompt(random.Random(8), 20)
    spec = SpeculativeConfig(method='ngram', num_speculative_tokens=2)
    with engine(tiny_models, backend, dp=1) as single:
        single.load_adapter(adapter)
        expected = single.get_logits(ids, 'attn'), single.get_hidden_states(ids)
    with engine(tiny_models, backend, speculative_config=spec) as dp:
        assert all(r.config.speculative_config == spec for r in dp.replicas)
        dp.load_adapter(adapter)
        assert dp.adapter_names() == ['attn'] and all(r.adapter_names() == ['attn'] for r in dp.replicas)
        with pytest.raises(ValueError, match='already loaded'):
            dp.load_adapter(adapter)
        assert all(r.adapter_names() == ['attn'] for r in dp.replicas)  # the failed load undid nothing else
        torch.testing.assert_close(dp.get_logits(ids, 'attn'), expected[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(dp.get_hidden_states(ids), expected[1], rtol=0, atol=1e-5)
        # a session on the second replica holds the adapter: the first lets it go, the second refuses, and
        # the first loads it again
        col = Collector()
        for sid in (8, 9):  # without prefix caching, requests one at a time take turns
            dp.add_request(EngineRequest(sid, tuple(ids), SamplingParams(max_new_tokens=2), sequence_end=sid == 8,
                                         adapter='attn'), col.callback)
            col.wait([sid])
        assert dp.replica_of(9) == 1
        with pytest.raises(ValueError, match='in use'):
            dp.unload_adapter('attn')
        assert all(r.adapter_names() == ['attn'] for r in dp.replicas)
        dp.end(9)
        dp.unload_adapter('attn')
        assert all(r.adapter_names() == [] for r in dp.replicas)


# ---- SmolLM2 end to end: pipeline(..., dp=2) -------------------------------------------------------------

SMOL_PROMPTS = ['What is the capital of France?', 'Write a haiku about the sea.', 'Count from one to five.',
                'Name three colors.']


def test_smollm2_pipeline_dp2_answers_as_one_engine(smollm2_dir):
    from lmd import GenerationConfig, pipeline
    gen = GenerationConfig(max_new_tokens=16)
    answers = {}
    for dp in (1, 2):
        config = TurbomindEngineConfig(dp=dp, num_threads=dp, session_len=512, enable_prefix_caching=True)
        pipe = pipeline(smollm2_dir, backend_config=config)
        try:
            answers[dp] = [r.text for r in pipe(SMOL_PROMPTS, gen_config=gen)]
            if dp == 2:
                assert [s.num_prompt_tokens > 0 for s in pipe.async_engine.replica_stats()] == [True, True]
        finally:
            pipe.close()
    assert answers[2] == answers[1] and all(answers[1])


# ---- the proxy's prefix_aware strategy in front of two real api_servers -----------------------------------

def test_proxy_prefix_aware_sends_a_prefix_to_the_node_that_holds_it(tmp_path, smollm2_dir):
    from server_utils import tiny_model_dir
    from test_proxy import Server, free_port, metric, nodes_status, openai_client, start_proxy, stop_all, wait_nodes
    model = tiny_model_dir(str(tmp_path / 'tiny'), smollm2_dir)
    proxy = start_proxy(tmp_path, '--routing-strategy', 'prefix_aware')
    nodes = [proxy]
    try:
        for name in ('node0', 'node1'):
            port = free_port()
            nodes.append(Server(name, ['-m', 'lmd.serve.api_server', model, '--model-name', 'tiny',
                                       '--server-name', '127.0.0.1', '--server-port', str(port), '--proxy-url',
                                       proxy.url, '--num-threads', '1', '--enable-prefix-caching',
                                       '--cache-block-seq-len', '16', '--log-level', 'WARNING'], port, tmp_path))
        for node in nodes[1:]:
            node.wait_ready(ok=(200,), timeout=240)
        wait_nodes(proxy, {n.url: True for n in nodes[1:]})
        client = openai_client(proxy)
        rng = random.Random(9)
        words = 'alpha beta gamma delta river stone cloud maple orbit lantern'.split()
        documents = [' '.join(rng.choice(words) for _ in range(120)) for _ in range(3)]
        where = {}
        for turn in range(3):  # each document with a new question, the documents interleaved
            for d, doc in enumerate(documents):
                before = {url: n['requests'] for url, n in nodes_status(proxy).items()}
                client.completions.create(model='tiny', prompt=f'{doc}\nQuestion {turn}: why?', max_tokens=2)
                after = nodes_status(proxy)
                sent = [url for url, n in after.items() if n['requests'] > before[url]]
                where.setdefault(d, set()).update(sent)
        assert all(len(urls) == 1 for urls in where.values()), where  # a document's requests: one node
        assert len(set().union(*where.values())) == 2, where  # the documents spread over both
        hits = [metric(n, 'lmd:prefix_cache_hits_total') for n in nodes[1:]]
        assert all(h > 0 for h in hits), hits  # each node served its documents' prefixes from its cache
        status = httpx.get(proxy.url + '/nodes/status', timeout=5).json()
        assert status['routing_strategy'] == 'prefix_aware'
    finally:
        stop_all(nodes)


def test_request_prefix_reads_what_the_proxy_sees():
    from lmd.serve.proxy_nodes import request_prefix
    chat = {'messages': [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': [
        {'type': 'text', 'text': 'hi'}, {'type': 'image_url', 'image_url': {'url': 'x'}}]}]}
    assert request_prefix(chat) == '\x00system\x00S\x00user\x00hi'
    longer = {'messages': chat['messages'] + [{'role': 'assistant', 'content': 'yo'}]}
    assert request_prefix(longer).startswith(request_prefix(chat))  # a conversation extends its prefix
    assert request_prefix({'prompt': 'abc'}) == 'abc' and request_prefix({'prompt': ['abc', 'd']}) == 'abc'
    assert request_prefix({'prompt': [1, 2, 3]}) == [1, 2, 3] and request_prefix({'prompt': [[4, 5], [6]]}) == [4, 5]
    assert request_prefix({'input': 'e'}) == 'e' and request_prefix({'model': 'm'}) is None


def test_async_engine_through_dp_streams_and_aborts(tiny_models):
    """Outputs on the caller's loop (AsyncEngine's path), and aborts, over two TurboMind replicas."""
    with engine(tiny_models, 'turbomind') as dp:
        async def run():
            loop = asyncio.get_running_loop()
            queues = []
            for sid in range(6):
                q: asyncio.Queue = asyncio.Queue()
                dp.add_request(EngineRequest(sid, (3, 4, 5, sid), SamplingParams(max_new_tokens=200)),
                               q.put_nowait, loop=loop)
                queues.append(q)
            await queues[0].get()
            for sid in range(6):
                dp.abort(sid)
            reasons = []
            for q in queues:
                while (out := await q.get()).finish_reason is None:
                    pass
                reasons.append(out.finish_reason)
            return reasons
        assert set(asyncio.run(run())) <= {'abort', 'length'}
        st = dp.stats()
        assert st.num_running == st.num_waiting == 0
