"""Text for calibration and perplexity that works offline.

The default is English prose that ships with Python itself: the reference topics of
``pydoc_data.topics``, split into two disjoint parts so perplexity is never measured on
text the quantizer saw: two long prose topics, "compound" (compound statements) and
"debugger" (pdb), about 71 000 characters or 17 000 SmolLM2 tokens, are held out for
evaluation; the other 77 topics (about 394 000 characters) are for calibration. (The topics change a little between Python
versions, so figures compare only within one version.)
"""
from __future__ import annotations

BUILTIN = 'pydoc'
HELD_OUT = ('compound', 'debugger')


def builtin_text(split: str) -> str:
    """``split``: 'calib' (the calibration topics) or 'eval' (the held-out ones), each
    topic's text in sorted topic order, separated by blank lines."""
    if split not in ('calib', 'eval'):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    from pydoc_data.topics import topics
    names = sorted(topics)
    held_out = split == 'eval'
    return '\n\n'.join(topics[name] for name in names if (name in HELD_OUT) == held_out)
