"""``lmd serve triton``: write a Triton Inference Server model repository for a model, and run it.

The repository holds lmd's models from ``lmd.triton_models`` (see its README.md):
``preprocessing`` -> ``engine`` -> ``postprocessing`` chained by ``ensemble``, and
``lmd_model``, the whole pipeline in one decoupled model. Each ``config.pbtxt``
points at the model by path; the weights are never copied.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import string
import time
from importlib import resources

logger = logging.getLogger('lmd.serve')

MODELS = ('preprocessing', 'engine', 'postprocessing', 'ensemble', 'lmd_model')
ENSEMBLE_STEPS = ('preprocessing', 'engine', 'postprocessing')


def _template_dir() -> str:
    return str(resources.files('lmd.triton_models'))


def _models_to_write(models) -> list[str]:
    if isinstance(models, str):
        models = [m for m in models.split(',') if m]
    wanted = list(models)
    bad = [m for m in wanted if m not in MODELS]
    if bad or not wanted:
        raise ValueError(f'models={models!r} is invalid: choose from {", ".join(MODELS)}')
    if 'ensemble' in wanted:  # it needs its steps
        wanted += [m for m in ENSEMBLE_STEPS if m not in wanted]
    return [m for m in MODELS if m in wanted]


def build_repository(model_path: str | None, model_repository: str, backend: str = 'auto',
                     models=MODELS, chat_template: str | None = None, postprocessing_instances: int = 1,
                     **engine_fields) -> str:
    """Write lmd's Triton models for ``model_path`` into ``model_repository``; returns its path.

    ``engine_fields`` are TurbomindEngineConfig / PytorchEngineConfig fields (session_len,
    cache_max_entry_count, device...). Other models already in the repository are left alone.
    """
    from lmd.backend import CONFIGS, PYTORCH_FIELDS, check_backend, command_engine_config, resolve_backend
    from lmd.model_path import prepare_model_dir, resolve_model_path

    check_backend(backend)
    path = resolve_model_path(model_path)
    model_dir = prepare_model_dir(path)  # fails now, not when Triton loads it; converts a GGUF once
    fields = {k: v for k, v in engine_fields.items() if v is not None}
    if 'ray_address' in fields:  # as the commands read --ray-address
        fields.setdefault('distributed_executor_backend', 'ray')
    # 'auto' is decided here: the engine models are told which engine to build (the PyTorch engine's
    # own fields, pp and the executor, ask for it; TurboMind refuses them). Only the fields that choose
    # an engine go in: the others (max_cache_memory_gib...) are checked by the chosen engine's config.
    asked = command_engine_config({k: v for k, v in fields.items()
                                   if k in ('model_format', 'device', *PYTORCH_FIELDS)}, backend)
    backend, why = resolve_backend(model_dir, backend, asked)
    config = CONFIGS[backend](**fields)  # checks them
    logger.info('engine %s (%s)', backend, why)
    if not isinstance(postprocessing_instances, int) or postprocessing_instances < 1:
        raise ValueError(f'postprocessing_instances={postprocessing_instances!r} is invalid: expected >= 1')
    values = {
        'model_path': json.dumps(path),
        'backend': json.dumps(backend),
        'engine_config': json.dumps(json.dumps(fields, sort_keys=True)),
        'chat_template': json.dumps(chat_template or ''),
        'kind': 'KIND_GPU' if str(config.device).startswith('cuda') else 'KIND_CPU',
        'postprocessing_instances': str(postprocessing_instances),
    }
    names = _models_to_write(models)
    src = _template_dir()
    os.makedirs(model_repository, exist_ok=True)
    for name in names:
        out = os.path.join(model_repository, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(os.path.join(out, '1'))
        model_py = os.path.join(src, name, '1', 'model.py')
        if os.path.isfile(model_py):
            shutil.copyfile(model_py, os.path.join(out, '1', 'model.py'))
        with open(os.path.join(src, name, 'config.pbtxt')) as f:
            text = string.Template(f.read()).substitute(values)
        with open(os.path.join(out, 'config.pbtxt'), 'w') as f:
            f.write(text)
    return os.path.abspath(model_repository)


def serve_triton(model_path: str | None = None, *, model_repository: str = 'triton_repository',
                 backend: str = 'auto', models: str = ','.join(MODELS), chat_template: str | None = None,
                 launch: bool = False, server_name: str = '127.0.0.1', http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, postprocessing_instances: int = 1,
                 session_len: int | None = None, max_batch_size: int | None = None,
                 cache_max_entry_count: float | None = None, cache_block_seq_len: int | None = None,
                 enable_prefix_caching: bool = False, quant_policy: int = 0, model_format: str | None = None,
                 dtype: str = 'auto', num_threads: int | None = None, device: str | None = None, tp: int = 1,
                 dp: int = 1, pp: int = 1, distributed_executor_backend: str | None = None,
                 ray_address: str | None = None) -> int:
    """Write a Triton Inference Server model repository for a model; --launch also runs tritonserver on it.

    The repository holds ensemble (preprocessing -> engine -> postprocessing) and lmd_model (the whole
    pipeline in one model); both take a prompt and stream text over gRPC (see `lmd serve triton_client`).
    config.pbtxt files point at the model; nothing is copied. tritonserver comes from
    pip install "lmd[triton]".

    Args:
        model_path: an HF model directory, a .gguf file, an AWQ/W8A8 directory, or 'smollm2' (the default).
        model_repository: the folder to write (other models in it are left alone).
        backend: the engine the models host: 'auto' (TurboMind where it runs the model, else PyTorch),
            'turbomind' or 'pytorch'.
        models: which models to write, separated by commas (ensemble brings its three steps).
        chat_template: a built-in template name (chatml, llama3, qwen2, internlm2, base) instead of the model's.
        launch: start tritonserver on the repository and serve until Ctrl-C.
        server_name: the address tritonserver listens on, with --launch.
        http_port: tritonserver's HTTP port, with --launch.
        grpc_port: tritonserver's gRPC port, with --launch.
        metrics_port: tritonserver's Prometheus metrics port, with --launch.
        postprocessing_instances: instances of the postprocessing model (detokenization).
        session_len: the longest context in tokens (default: the model's, at most 8192).
        max_batch_size: requests the engine runs at once.
        cache_max_entry_count: the fraction of free memory the KV cache may take.
        cache_block_seq_len: tokens per KV cache block.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        quant_policy: KV cache quantization: 0 none, 8 int8, 4 int4.
        model_format: hf, awq, w8a8 or gguf (default: from the model).
        dtype: auto, float32, bfloat16 or float16.
        num_threads: CPU threads for the engine (default: all cores).
        device: cpu or cuda (cuda puts the engine models in KIND_GPU instances).
        tp: tensor parallel degree.
        dp: data-parallel replicas of the engine inside each engine model instance, each with
            NUM_THREADS // DP threads.
        pp: pipeline parallel stages (PyTorch engine).
        distributed_executor_backend: how the PyTorch engine starts its tp x pp ranks: mp (local processes,
            the default) or ray.
        ray_address: the Ray cluster for the ranks (default: RAY_ADDRESS, else a local one); implies
            --distributed-executor-backend ray.

    Returns tritonserver's exit status with --launch, else 0.
    """
    # only what differs from the engine's defaults goes into the repository's engine_config
    engine_fields = dict(session_len=session_len, max_batch_size=max_batch_size,
                         cache_max_entry_count=cache_max_entry_count, cache_block_seq_len=cache_block_seq_len,
                         enable_prefix_caching=enable_prefix_caching or None, quant_policy=quant_policy or None,
                         model_format=model_format, dtype=None if dtype == 'auto' else dtype,
                         num_threads=num_threads, device=device, tp=None if tp == 1 else tp,
                         dp=None if dp == 1 else dp, pp=None if pp == 1 else pp,
                         distributed_executor_backend=distributed_executor_backend, ray_address=ray_address)
    repo = build_repository(model_path, model_repository, backend=backend, models=models,
                            chat_template=chat_template, postprocessing_instances=postprocessing_instances,
                            **engine_fields)
    written = ', '.join(m for m in MODELS if os.path.isdir(os.path.join(repo, m)))
    print(f'wrote a Triton model repository to {repo} ({written})')
    if not launch:
        print(f'run it: lmd serve triton {model_path or "smollm2"} --model-repository {model_repository} --launch')
        return 0
    from .triton_server import TritonServer
    server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          address=server_name)
    print('starting tritonserver (loading the models takes a while)...', flush=True)

    def on_sigterm(signum, frame):  # stop the server (its own process group) on the way out
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server.start()
    print(f'tritonserver is ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}')
    print(f'chat with it: lmd serve triton_client {server.grpc_url}', flush=True)
    try:
        while server.proc.poll() is None:
            time.sleep(1)
        return server.proc.returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
