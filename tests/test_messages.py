"""Configs validate themselves and name the field, the value and what is allowed."""
import pytest

from lmd.engine import SamplingParams
from lmd.messages import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig


@pytest.mark.parametrize('field,value,needle', [
    ('temperature', -0.1, '>= 0.0'),
    ('top_p', 0.0, '> 0.0'),
    ('top_p', 1.5, '<= 1.0'),
    ('top_k', -1, '>= 0'),
    ('top_k', 2.5, 'integer'),
    ('min_p', 2.0, '<= 1.0'),
    ('repetition_penalty', 0.0, '> 0.0'),
    ('max_new_tokens', -5, '>= 0'),
    ('n', 0, '>= 1'),
    ('random_seed', -1, '>= 0'),
    ('logprobs', 50, '<= 20'),
    ('stop_words', [''], 'non-empty strings'),
    ('stop_token_ids', [-3], 'non-negative'),
    ('temperature', float('nan'), 'NaN'),
])
def test_generation_config_rejects(field, value, needle):
    with pytest.raises(ValueError) as e:
        GenerationConfig(**{field: value})
    msg = str(e.value)
    assert f'GenerationConfig.{field}=' in msg and needle in msg


def test_generation_config_normalises_lists_and_greedy():
    g = GenerationConfig(stop_words='###', stop_token_ids=7)
    assert g.stop_words == ['###'] and g.stop_token_ids == [7]
    assert GenerationConfig().greedy
    assert not GenerationConfig(do_sample=True).greedy
    assert GenerationConfig(do_sample=True, top_k=1).greedy
    with pytest.raises(ValueError, match='min_new_tokens'):
        GenerationConfig(min_new_tokens=10, max_new_tokens=5)


@pytest.mark.parametrize('cls', [PytorchEngineConfig, TurbomindEngineConfig])
@pytest.mark.parametrize('field,value,needle', [
    ('quant_policy', 3, '0, 4, 8'),
    ('cache_max_entry_count', 0.0, '> 0.0'),
    ('cache_max_entry_count', 1.2, '<= 1.0'),
    ('max_batch_size', 0, '>= 1'),
    ('cache_block_seq_len', 0, '>= 1'),
    ('model_format', 'onnx', "'awq'"),
    ('dtype', 'int3', "'bfloat16'"),
    ('session_len', -1, '>= 1'),
])
def test_engine_config_rejects(cls, field, value, needle):
    with pytest.raises(ValueError) as e:
        cls(**{field: value})
    msg = str(e.value)
    assert f'{cls.__name__}.{field}=' in msg and needle in msg


def test_cuda_kernel_backend_needs_a_cuda_device():
    """lmd's CUDA kernels on a CPU engine: refused at once, naming what to do instead."""
    with pytest.raises(ValueError, match=r"PytorchEngineConfig.kernel_backend='cuda' is invalid: .*device='cuda'.*"
                                         r"'native' or 'torch'.*LMD_WITH_CUDA=ON"):
        PytorchEngineConfig(kernel_backend='cuda')
    assert PytorchEngineConfig(kernel_backend='cuda', device='cuda:0').kernel_backend == 'cuda'
    with pytest.raises(ValueError, match="kernel_backend='cuda-graphs' is invalid: .*'triton', 'cuda'"):
        PytorchEngineConfig(kernel_backend='cuda-graphs', device='cuda')


def test_chat_template_config_names_builtins():
    assert ChatTemplateConfig('chatml').model_name == 'chatml'
    with pytest.raises(ValueError, match='llama3'):
        ChatTemplateConfig('no-such-template')


def test_sampling_params_fold_eos_unless_ignored():
    g = GenerationConfig(stop_token_ids=[5], do_sample=True, temperature=0.5, random_seed=3)
    p = SamplingParams.from_generation_config(g, eos_token_ids=(2, 5))
    assert p.stop_token_ids == (5, 2) and not p.greedy and p.random_seed == 3
    p = SamplingParams.from_generation_config(g.replace(ignore_eos=True), eos_token_ids=(2,))
    assert p.stop_token_ids == (5,)
