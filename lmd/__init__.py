"""lmd: LLM inference and serving, one pipeline() in front of two engines."""
from .messages import (ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, Response,
                       TurbomindEngineConfig)

__version__ = '0.1.0'

__all__ = ['pipeline', 'Pipeline', 'GenerationConfig', 'PytorchEngineConfig', 'TurbomindEngineConfig',
           'ChatTemplateConfig', 'Response', '__version__']


def __getattr__(name):
    # pipeline pulls in torch and transformers: import it on first use so `lmd --help` stays quick
    if name in ('pipeline', 'Pipeline'):
        import importlib
        return getattr(importlib.import_module('lmd.api'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
