"""Tensor and pipeline parallelism in the PyTorch engine: ``tp`` x ``pp`` ranks (gloo, one thread each)
give one rank's logits and greedy tokens, over local processes and over a Ray cluster; a rank that dies
ends every request held with an error that names it, and the engine closes instead of hanging."""
from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from lmd.engine import EngineRequest, SamplingParams
from lmd.errors import ModelFormatError
from lmd.messages import PytorchEngineConfig
from lmd.model_config import ModelConfig
from lmd.model_path import prepare_model_dir
from lmd.pytorch_backend import PytorchEngine
from lmd.pytorch_backend.model_runner import StepPlan
from lmd.pytorch_backend.pipeline_parallel import MIN_MICRO_BATCH_ROWS, micro_batches, stage_layers
from lmd.weights.tensor_parallel import check_tensor_parallel, shard_config, vocab_range
from test_pytorch_engine import Collector, assert_no_leak, generate
from test_turbomind_formats import save_quantized
from tiny_models import tiny_hf_model

# tp ranks sum the attention's and the MLP's partial products in another order than one rank does
LOGITS_TOL = 1e-4
ENGINE = dict(dtype='float32', num_threads=1, cache_block_seq_len=8, num_cache_blocks=96, max_prefill_token_num=24)
TINY = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # 203: the vocabulary splits unevenly
MOE = {  # the experts (and Qwen2-MoE's shared expert, beside a dense layer) split by their intermediate sizes
    'mixtral': ('MixtralConfig', 'MixtralForCausalLM', dict(num_local_experts=4, num_experts_per_tok=2)),
    'qwen2_moe': ('Qwen2MoeConfig', 'Qwen2MoeForCausalLM',
                  dict(num_hidden_layers=3, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
}
FAMILIES = {
    'llama': ('LlamaConfig', 'LlamaForCausalLM', dict(attention_bias=True, mlp_bias=True)),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', dict(tie_word_embeddings=True)),
    'phi3': ('Phi3Config', 'Phi3ForCausalLM', dict(pad_token_id=0)),  # fused qkv_proj and gate_up_proj
    'gemma2': ('Gemma2Config', 'Gemma2ForCausalLM', dict(head_dim=16, sliding_window=8)),  # soft-caps, windows
    'mqa': ('LlamaConfig', 'LlamaForCausalLM', dict(num_key_value_heads=1)),  # the KV head replicated
}
# token ids below 160, the smallest tiny vocabulary here (save_quantized's)
PROMPTS = [[5, 17, 99, 3, 41, 8, 150, 23, 77, 12, 155, 9, 31, 64, 2, 18, 90],
           [7, 7, 120, 33], [140, 4, 56, 91, 13, 2, 60, 101, 44]]


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            cfg_name, model_name, extra = FAMILIES[family]
            model, _ = tiny_hf_model(cfg_name, model_name, seed=1, **{**TINY, **extra})
            path = str(tmp_path_factory.mktemp(family))
            model.save_pretrained(path, safe_serialization=True)
            cache[family] = path
        return cache[family]
    return get


def run(model_dir: str, n: int = 12, **cfg) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """(teacher-forced logits of PROMPTS[0] through the paged cache, greedy tokens of every prompt in one
    batch, ``get_logits`` of PROMPTS[2]) of one engine."""
    with PytorchEngine(model_dir, PytorchEngineConfig(**{**ENGINE, **cfg})) as engine:
        logits = engine.teacher_forced_logits(PROMPTS[0][:9], PROMPTS[0][9:])
        tokens, _ = generate(engine, PROMPTS, SamplingParams(max_new_tokens=n))
        scored = engine.get_logits(PROMPTS[2])
        assert_no_leak(engine)
        return logits, tokens, scored


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=LOGITS_TOL)
    assert a[1] == b[1]
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=LOGITS_TOL)


@pytest.mark.parametrize('family', FAMILIES)
def test_tp2_equals_tp1(tiny_dir, family):
    path = tiny_dir(family)
    assert_same(run(path, tp=2), run(path))


@pytest.mark.parametrize('family,parallel', [('mixtral', dict(tp=2)), ('qwen2_moe', dict(tp=2)),
                                             ('qwen2_moe', dict(pp=2))])
def test_moe(tmp_path, family, parallel):
    cfg_name, model_name, extra = MOE[family]
    model, _ = tiny_hf_model(cfg_name, model_name, seed=1, **{**TINY, **extra})
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    assert_same(run(str(tmp_path), **parallel), run(str(tmp_path)))


@pytest.mark.parametrize('family', ['llama', 'qwen2', 'gemma2'])  # qwen2: lm_head tied to the embedding
def test_pp2_equals_pp1(tiny_dir, family):
    path = tiny_dir(family)
    assert_same(run(path, pp=2), run(path))


def test_pp2_micro_batches(tiny_dir):
    """Three prompts prefilled in one step of 220 rows: two micro-batches in flight through the stages
    (``MIN_MICRO_BATCH_ROWS``); tokens, their logprobs and the prompts' logprobs are one rank's."""
    assert 220 // MIN_MICRO_BATCH_ROWS >= 2  # enough rows to cut the step
    rng = random.Random(0)
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (70, 90, 60)]
    sampling = SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=2)

    def outputs(**parallel):
        cfg = PytorchEngineConfig(**{**ENGINE, 'max_prefill_token_num': 256}, **parallel)
        with PytorchEngine(tiny_dir('llama'), cfg) as engine:
            col = Collector()
            for sid, p in enumerate(prompts):
                engine.add_request(EngineRequest(sid, tuple(p), sampling), col.callback)
            col.wait(range(3))
            assert_no_leak(engine)
            if parallel:
                assert engine.runner.parallel_stats()[1]['send_recv_s'] > 0
            return [[(o.token_ids, o.logprobs, o.prompt_logprobs) for o in col.outputs[sid]] for sid in range(3)]

    one, two = outputs(), outputs(pp=2)
    for a, b in zip(one, two):  # float32 logprobs computed in the same order: equal, not close
        assert a == b


def test_tp2_pp2(tiny_dir):
    """Four ranks: two stages of two tensor-parallel ranks each, the stages' collectives in groups of their own."""
    path = tiny_dir('phi3')
    assert_same(run(path, tp=2, pp=2), run(path))


@pytest.fixture(scope='module')
def smollm2_reference():
    path = prepare_model_dir('smollm2')
    return path, run(path, n=32, **SMOLLM2)


SMOLLM2 = dict(num_cache_blocks=48, max_prefill_token_num=64)


@pytest.mark.parametrize('parallel', [dict(tp=3), dict(pp=2)], ids=['tp3', 'pp2'])
def test_smollm2_gguf(smollm2_reference, parallel):
    """The shipped Q4_1 GGUF (9 heads, 3 KV heads, 49152 rows of vocabulary) over three ranks, and its 30
    layers in two stages."""
    path, reference = smollm2_reference
    assert_same(run(path, n=32, **parallel, **SMOLLM2), reference)


@pytest.mark.parametrize('parallel', [dict(tp=2), dict(pp=2)], ids=['tp2', 'pp2'])
def test_awq(tmp_path, parallel):
    """W4A16 matmuls split on their groups: o_proj's and down_proj's K in halves of whole groups."""
    path = str(tmp_path / 'awq')
    save_quantized('llama', path, 'awq', 32)
    assert_same(run(path, **parallel), run(path))


def test_stage_layers():
    """Contiguous stages of at least a layer covering every layer once; lm_head's weight (49152 x 576, about
    eight SmolLM2 layers) leaves the last stage fewer layers."""
    mc = ModelConfig.from_dir(prepare_model_dir('smollm2'))
    for pp in (1, 2, 3, 30):
        stages = stage_layers(mc, pp)
        assert [i for r in stages for i in r] == list(range(30)) and all(len(r) for r in stages)
    first, last = stage_layers(mc, 2)
    assert len(first) > len(last) + 4, (first, last)
    with pytest.raises(ValueError, match='pp=31 stages need 1 <= pp <= the 30 decoder layers'):
        stage_layers(mc, 31)


def test_micro_batches():
    """Runs of whole sequences of about equal rows whose fields, joined, are the step's."""
    lens, ctx = [5, 1, 1, 7, 2], [9, 4, 6, 7, 3]
    cu = [0, 5, 6, 7, 14, 16]
    plan = StepPlan(input_ids=list(range(100, 116)), positions=list(range(16)), slots=list(range(200, 216)),
                    query_lens=lens, cu_query_lens=cu, context_lens=ctx, block_table=list(range(10)), max_blocks=2,
                    row_slots=[0] * 16, logit_rows=[4, 5, 6, 12, 13, 15],
                    prompt_jobs=[(0, 0, 4, [1, 2, 3, 4], 2), (3, 7, 13, [5] * 6, 1)])
    runs = micro_batches(plan, 3)
    assert [first for _, first in runs] == [0, 2, 4]
    assert [r.query_lens for r, _ in runs] == [[5, 1], [1, 7], [2]]
    assert sum((r.input_ids for r, _ in runs), []) == plan.input_ids
    assert sum((r.block_table for r, _ in runs), []) == plan.block_table
    assert [r.cu_query_lens for r, _ in runs] == [[0, 5, 6], [0, 1, 8], [0, 2]]
    assert [r.logit_rows for r, _ in runs] == [[4, 5], [0, 6, 7], [1]]
    assert [r.prompt_jobs for r, _ in runs] == [[(0, 0, 4, [1, 2, 3, 4], 2)], [(1, 1, 7, [5] * 6, 1)], []]
    assert micro_batches(plan, 9)[-1][1] == 4 and len(micro_batches(plan, 9)) == 5  # a sequence each at most


def test_shards(tiny_dir):
    """Each rank's heads, columns of I and rows of the vocabulary; one KV head held by both ranks."""
    mc = ModelConfig.from_dir(tiny_dir('mqa'))
    rank1 = shard_config(mc, 1, 2)
    assert (rank1.num_heads, rank1.num_kv_heads, rank1.intermediate_size, rank1.vocab_size) == (2, 1, 48, 102)
    assert vocab_range(203, 1, 2) == (102, 203)


def test_tp_refusals(tiny_dir, tmp_path):
    path = tiny_dir('llama')
    with pytest.raises(ModelFormatError, match='tp=3 must divide the 4 attention heads'):
        PytorchEngine(path, PytorchEngineConfig(**ENGINE, tp=3))
    with pytest.raises(ValueError, match='LoRA adapters'):
        PytorchEngine(path, PytorchEngineConfig(**ENGINE, tp=2, adapters={'a': str(tmp_path)}))
    moe, _ = tiny_hf_model('MixtralConfig', 'MixtralForCausalLM', **{**TINY, 'num_local_experts': 4,
                                                                      'num_experts_per_tok': 2})
    moe.save_pretrained(str(tmp_path / 'moe'), safe_serialization=True)
    mc = ModelConfig.from_dir(str(tmp_path / 'moe'))
    with pytest.raises(ModelFormatError, match="tp=2 must divide the experts' intermediate size 95"):
        check_tensor_parallel(dataclasses.replace(mc, moe=dataclasses.replace(mc.moe, intermediate_size=95)), 2)
    with pytest.raises(ModelFormatError, match='stacked and interleaved'):
        check_tensor_parallel(dataclasses.replace(mc, family='gpt_oss'), 2)
    with pytest.raises(ValueError, match='pp=3 is invalid: the model has 2 decoder layers'):
        PytorchEngine(path, PytorchEngineConfig(**ENGINE, pp=3))
    with pytest.raises(ValueError, match='tp=1, pp=2: .* without LoRA adapters'):
        PytorchEngine(path, PytorchEngineConfig(**ENGINE, pp=2, adapters={'a': str(tmp_path)}))


def kill_rank_mid_request(engine, kill) -> None:
    """Start a long request, ``kill()`` a rank once its first tokens are out, and check that the request
    ends with an error naming the rank, that the engine then refuses new work saying why, and closes."""
    first_tokens, done, outputs = threading.Event(), threading.Event(), []

    def on_output(out):
        outputs.append(out)
        first_tokens.set()
        if out.finish_reason is not None:
            done.set()
    engine.add_request(EngineRequest(session_id=1, token_ids=PROMPTS[0],
                                     sampling=SamplingParams(max_new_tokens=200)), on_output)
    assert first_tokens.wait(60)
    kill()
    assert done.wait(60), 'the request never ended after its rank died'
    assert outputs[-1].finish_reason == 'error'
    assert 'rank 1' in outputs[-1].error, outputs[-1].error
    with pytest.raises(RuntimeError, match='engine is closed: parallel ranks: rank 1'):
        engine.add_request(EngineRequest(session_id=2, token_ids=PROMPTS[1], sampling=SamplingParams()),
                           lambda out: None)
    engine.close()


@pytest.mark.parametrize('parallel', [dict(tp=2), dict(pp=2)], ids=['tp2', 'pp2'])
def test_rank_death_ends_requests(tiny_dir, parallel):
    """With pp=2 rank 1 is the last stage: the driver waits on its logits when it dies."""
    engine = PytorchEngine(tiny_dir('llama'), PytorchEngineConfig(**ENGINE, **parallel))
    kill_rank_mid_request(engine, lambda: engine.executor._procs[0].kill())


@pytest.fixture(scope='module')
def ray_cluster():
    """A local Ray cluster of two logical nodes of one CPU each."""
    ray = pytest.importorskip('ray', reason='Ray is not installed (pip install ray)')
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1))
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize('parallel', [dict(tp=2), dict(pp=2)], ids=['tp2', 'pp2'])
def test_ray_ranks_on_two_nodes(tiny_dir, ray_cluster, parallel):
    import ray
    path = tiny_dir('llama')
    cfg = dict(**parallel, distributed_executor_backend='ray', ray_address=ray_cluster.address)
    assert_same(run(path, **cfg), run(path))
    engine = PytorchEngine(path, PytorchEngineConfig(**ENGINE, **cfg))
    # a bundle a node: rank 1's actor runs on the other node than rank 0's bundle
    bundles = ray.util.placement_group_table(engine.executor._placement_group)['bundles_to_node_id']
    assert len(set(bundles.values())) == 2
    kill_rank_mid_request(engine, lambda: ray.kill(engine.executor._actors[0]))
