"""Tensor parallelism in the PyTorch engine: ``tp`` ranks (gloo, one thread each) give tp=1's logits and
greedy tokens, over local processes and over a Ray cluster; a rank that dies ends every request held with
an error that names it, and the engine closes instead of hanging."""
from __future__ import annotations

import threading

import pytest
import torch

from lmd.engine import EngineRequest, SamplingParams
from lmd.errors import ModelFormatError
from lmd.messages import PytorchEngineConfig
from lmd.model_config import ModelConfig
from lmd.model_path import prepare_model_dir
from lmd.pytorch_backend import PytorchEngine
from lmd.weights.tensor_parallel import shard_config, vocab_range
from test_pytorch_engine import assert_no_leak, generate
from test_turbomind_formats import save_quantized
from tiny_models import tiny_hf_model

# tp ranks sum the attention's and the MLP's partial products in another order than one rank does
LOGITS_TOL = 1e-4
ENGINE = dict(dtype='float32', num_threads=1, cache_block_seq_len=8, num_cache_blocks=96, max_prefill_token_num=24)
TINY = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # 203: the vocabulary splits unevenly
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


def test_tp3_smollm2_gguf():
    """The shipped Q4_1 GGUF (9 heads, 3 KV heads, 49152 rows of vocabulary) over three ranks."""
    path = prepare_model_dir('smollm2')
    cfg = dict(num_cache_blocks=48, max_prefill_token_num=64)
    assert_same(run(path, n=32, tp=3, **cfg), run(path, n=32, **cfg))


def test_tp2_awq(tmp_path):
    """W4A16 matmuls split on their groups: o_proj's and down_proj's K in halves of whole groups."""
    path = str(tmp_path / 'awq')
    save_quantized('llama', path, 'awq', 32)
    assert_same(run(path, tp=2), run(path))


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
    with pytest.raises(ModelFormatError, match='mixture of experts is not sharded yet'):
        PytorchEngine(str(tmp_path / 'moe'), PytorchEngineConfig(**ENGINE, tp=2))


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
    with pytest.raises(RuntimeError, match='engine is closed: tensor parallelism: rank 1'):
        engine.add_request(EngineRequest(session_id=2, token_ids=PROMPTS[1], sampling=SamplingParams()),
                           lambda out: None)
    engine.close()


def test_rank_death_ends_requests(tiny_dir):
    engine = PytorchEngine(tiny_dir('llama'), PytorchEngineConfig(**ENGINE, tp=2))
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


def test_ray_ranks_on_two_nodes(tiny_dir, ray_cluster):
    import ray
    path = tiny_dir('llama')
    cfg = dict(tp=2, distributed_executor_backend='ray', ray_address=ray_cluster.address)
    assert_same(run(path, **cfg), run(path))
    engine = PytorchEngine(path, PytorchEngineConfig(**ENGINE, **cfg))
    # a bundle a node: rank 1's actor runs on the other node than rank 0's bundle
    bundles = ray.util.placement_group_table(engine.executor._placement_group)['bundles_to_node_id']
    assert len(set(bundles.values())) == 2
    kill_rank_mid_request(engine, lambda: ray.kill(engine.executor._actors[0]))
