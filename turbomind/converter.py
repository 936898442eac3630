"""What TurboMind runs from a model directory, and its own layout (``lmd convert --backend turbomind``).

Both are the weights layer's (``lmd.weights.turbomind_layout``): ``lmd convert`` in the core writes
the layout and this engine reads it, neither importing the other. This module keeps the names
TurboMind's callers know; ``engine.py`` loads through ``load_fused``.
"""
from lmd.weights.source_format import source_format  # noqa: F401
from lmd.weights.turbomind_layout import (FORMAT, FORMAT_VERSION, HF_FILES, MODEL_KEYS, WEIGHTS_FILE,  # noqa: F401
                                          TurbomindFormatError, _digest, export, is_converted, load_fused, read)
