"""The kernel library's CUDA kernels (lib/kernels/csrc/cuda) against the CPU references they must
equal: the same random inputs on both devices, float32 to float rounding, float16/bfloat16 to one
or two units in the last place of the output dtype. Skipped without a CUDA device or a CUDA build."""
import pytest
import torch

from lmd.kernels import cuda, ops
from cuda_utils import cap, requires_cuda_kernels, stream

pytestmark = requires_cuda_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# |gpu - cpu reference| <= atol + rtol |reference|: float32 differs only by expf's rounding; the
# half types by one rounding of the output (both sides compute in float and round once)
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}


def close(gpu: torch.Tensor, ref: torch.Tensor, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(gpu.cpu().float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('T,I', [(1, 1536), (7, 576), (64, 8960), (3, 1)])
def test_silu_and_mul(T, I, dtype):
    g = torch.Generator().manual_seed(T * 1000 + I)
    x = (torch.randn(T, 2 * I, generator=g) * 3).to(dtype)
    ref = torch.empty(T, I, dtype=dtype)
    ops.silu_and_mul(cap(x), cap(ref), reference=True)
    xd = x.cuda()
    out = torch.full((T, I), float('nan'), dtype=dtype, device='cuda')
    cuda.silu_and_mul(cap(xd), cap(out), stream())
    close(out, ref, dtype)


def test_bad_input_is_named():
    x = torch.zeros(2, 6, device='cuda')
    with pytest.raises(ValueError, match='out'):
        cuda.silu_and_mul(cap(x), cap(torch.zeros(2, 4, device='cuda')), stream())
    with pytest.raises(ValueError, match='not on a CUDA device'):
        cuda.silu_and_mul(cap(x.cpu()), cap(torch.zeros(2, 3, device='cuda')), stream())
