"""The terminal prompt loop of ``lmd chat``, ``lmd serve api_client`` and ``lmd serve triton_client``.

Each reads a line at ``>>>``; blank lines are skipped, ``/reset`` starts a new conversation,
``/exit``, Ctrl-D (end of input) and Ctrl-C at the prompt leave. What a client does with a
message, and with Ctrl-C while an answer streams, is its own.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

HELP = 'Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) leaves.'
PROMPT = '\n>>> '


def read_turns(on_reset: Callable[[], None], out=None) -> Iterator[str]:
    """Yield each message the user types until they leave; ``/reset`` calls ``on_reset`` and says so."""
    out = out or sys.stdout
    while True:
        try:
            line = input(PROMPT)
        except (EOFError, KeyboardInterrupt):
            return
        message = line.strip()
        if message == '/exit':
            return
        if not message:
            continue
        if message == '/reset':
            on_reset()
            print('(new conversation)', file=out, flush=True)
            continue
        yield message
