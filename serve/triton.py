"""``lmd serve triton``: write a Triton Inference Server model repository for a model, and run it.

The repository holds lmd's models from ``lmd.triton_models`` (see its README.md):
``preprocessing`` -> ``engine`` -> ``postprocessing`` chained by ``ensemble``, and
``lmd_model``, the whole pipeline in one decoupled model. Each ``config.pbtxt``
points at the model by path; the weights are never copied.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import string
import time
from importlib import resources

from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig

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


def build_repository(model_path: str | None, model_repository: str, backend: str | None = None,
                     models=MODELS, chat_template: str | None = None, postprocessing_instances: int = 1,
                     **engine_fields) -> str:
    """Write lmd's Triton models for ``model_path`` into ``model_repository``; returns its path.

    ``engine_fields`` are TurbomindEngineConfig / PytorchEngineConfig fields (session_len,
    cache_max_entry_count, device...). Other models already in the repository are left alone.
    """
    from lmd.model_path import prepare_model_dir, resolve_model_path

    path = resolve_model_path(model_path)
    prepare_model_dir(path)  # fails now, not when Triton loads it; converts a GGUF once
    backend = backend or 'turbomind'  # it runs every format lmd reads, and it is the faster engine
    if backend not in ('turbomind', 'pytorch'):
        raise ValueError(f"backend={backend!r} is invalid: allowed values are 'turbomind', 'pytorch'")
    fields = {k: v for k, v in engine_fields.items() if v is not None}
    config = (TurbomindEngineConfig if backend == 'turbomind' else PytorchEngineConfig)(**fields)  # checks them
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


def serve_triton(model_path: str | None = None, model_repository: str = 'triton_repository',
                 backend: str | None = None, models=MODELS, chat_template: str | None = None,
                 launch: bool = False, server_name: str = '127.0.0.1', http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, postprocessing_instances: int = 1,
                 **engine_fields) -> int:
    """Write the repository; with ``launch``, run tritonserver on it until interrupted."""
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
