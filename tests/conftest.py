import os

import pytest
import torch

# Two cores here: keep torch from oversubscribing them when tests run side by side.
THREADS = min(2, os.cpu_count() or 1)
torch.set_num_threads(THREADS)


@pytest.fixture(scope='module', autouse=True)
def thread_counts_restored():
    """Engines set torch's, the kernel library's and TurboMind's thread counts process-wide (many tests ask
    for one thread): each test module starts from the session's counts, so one such module does not leave
    every later one on a single core (the lite quality gates took 434 s instead of 268)."""
    from lmd.kernels import ops
    from lmd.turbomind import _turbomind
    for get, set_ in ((torch.get_num_threads, torch.set_num_threads), (ops.num_threads, ops.set_num_threads),
                      (_turbomind.num_threads, _turbomind.set_num_threads)):
        if get() != THREADS:
            set_(THREADS)
    yield


@pytest.fixture(scope='session')
def smollm2_dir() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF directory (converted once from its GGUF)."""
    from lmd.model_path import prepare_model_dir
    return prepare_model_dir('smollm2')


@pytest.fixture(scope='session')
def triton_server(tmp_path_factory):
    """One tritonserver for the session serving lmd's five models for SmolLM2 (see triton_utils)."""
    from triton_utils import build_smollm2_repository, start_triton
    out = str(tmp_path_factory.mktemp('triton'))
    server = start_triton(build_smollm2_repository(out), out)
    yield server
    server.stop()


@pytest.fixture(params=['avx2', 'avx512'])
def kernel_isa(request):
    """The test once per vector instruction set of the kernel library (lmd.kernels.ops.set_isa),
    skipped where this CPU lacks it; the level in use before is restored after."""
    from lmd.kernels import ops
    if request.param not in ops.supported_isas():
        pytest.skip(f'this CPU has no {request.param} (it runs {ops.supported_isas()})')
    old = ops.isa()
    ops.set_isa(request.param)
    try:
        yield request.param
    finally:
        ops.set_isa(old)
