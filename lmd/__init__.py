"""lmd: LLM inference and serving, one pipeline() in front of two engines."""
import pkgutil

# The wheel maps the repository's top-level folders (pytorch_backend/, turbomind/, ...) into
# this package. Run from a checkout after a plain `pip install .`, Python finds ./lmd first,
# which lacks them: let the installed copy supply the subpackages it has and this one lacks.
__path__ = pkgutil.extend_path(__path__, __name__)

from .messages import (ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, Response, SpeculativeConfig,
                       TurbomindEngineConfig)

__version__ = '0.1.0'

__all__ = ['pipeline', 'Pipeline', 'GenerationConfig', 'PytorchEngineConfig', 'TurbomindEngineConfig',
           'ChatTemplateConfig', 'Response', 'SpeculativeConfig', '__version__']


def __getattr__(name):
    # pipeline pulls in torch and transformers: import it on first use so `lmd --help` stays quick
    if name in ('pipeline', 'Pipeline'):
        import importlib
        return getattr(importlib.import_module('lmd.api'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
