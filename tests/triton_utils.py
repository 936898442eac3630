"""A real tritonserver on 127.0.0.1 serving lmd's repository for SmolLM2, for the Triton tests."""
from __future__ import annotations

import os
import queue
import tempfile

import numpy as np
import pytest

from server_utils import free_port

# The repository the tests serve: TurboMind on the embedded SmolLM2 GGUF, a short session_len so
# that an over-long prompt is cheap to send, and a small KV cache (two engines share the machine).
SESSION_LEN = 1024
ENGINE_FIELDS = dict(session_len=SESSION_LEN, cache_max_entry_count=0.05, enable_prefix_caching=True)


def start_triton(repo: str, log_dir: str):
    """tritonserver on ``repo``; a missing or broken installation fails the test with the reason."""
    from lmd.serve.triton_server import TritonNotInstalled, TritonServer
    ports = set()
    while len(ports) < 3:  # three different ones: each free_port() call may hand out the same
        ports.add(free_port())
    http_port, grpc_port, metrics_port = sorted(ports)
    server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          log_path=os.path.join(log_dir, 'tritonserver.log'))
    try:
        return server.start(timeout=600)
    except TritonNotInstalled as e:
        pytest.fail(f'the Triton tests need a tritonserver: {e}', pytrace=False)


def build_smollm2_repository(out: str, backend: str = 'turbomind', models=None, **fields) -> str:
    from lmd.serve.triton import MODELS, build_repository
    fields = {k: v for k, v in {**ENGINE_FIELDS, **fields}.items() if v is not None}
    return build_repository('smollm2', os.path.join(out, 'repo'), backend=backend, models=models or MODELS, **fields)


def grpc_input(name: str, value):
    """An InferInput holding ``value`` (a numpy array, or a str/list of str for a BYTES input)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype
    if isinstance(value, str):
        value = np.array([value.encode()], dtype=np.object_)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = np.array([v.encode() for v in value], dtype=np.object_)
    arr = np.asarray(value)
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype) if arr.dtype != object else 'BYTES')
    t.set_data_from_numpy(arr)
    return t


class Stream:
    """One gRPC bidirectional stream to a decoupled model: send requests, read their responses."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str, inputs: dict, request_id: str = '') -> None:
        self.client.async_stream_infer(model, [grpc_input(k, v) for k, v in inputs.items()],
                                       request_id=request_id, enable_empty_final_response=True)

    def read(self, timeout: float = 120):
        """(result, error) of the next response; raises queue.Empty after ``timeout``."""
        return self.responses.get(timeout=timeout)

    def collect(self, timeout: float = 120) -> tuple[list, str | None]:
        """Responses of one request up to its final flag: (results with data, error message or None)."""
        results = []
        while True:
            result, error = self.read(timeout)
            if error is not None:
                return results, str(error)
            if result.get_response().outputs:  # the empty final response carries none
                results.append(result)
            if result.get_response().parameters['triton_final_response'].bool_param:
                return results, None

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def text_of(results) -> str:
    return ''.join(r.as_numpy('text')[0].decode() for r in results)


def finish_reason_of(results) -> str:
    return results[-1].as_numpy('finish_reason')[0].decode() if results else ''


def new_tmpdir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)
