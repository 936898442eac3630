"""``lmd chat``: a terminal conversation that streams its answers.

The conversation is an interactive session: the engine keeps its KV cache
between turns, so each turn prefills only what the user just typed.
"""
from __future__ import annotations

import sys

HELP = 'Type a message and press Enter. /reset starts a new conversation, /exit leaves.'


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def run_chat(model_path, backend, engine_config, gen_config, chat_template_config=None, system=None,
             out=sys.stdout) -> None:
    from .api import pipeline
    pipe = pipeline(model_path, backend_config=engine_config, chat_template_config=chat_template_config,
                    backend=backend)
    try:
        print(f'lmd chat: {pipe.async_engine.model_dir} ({backend}). {HELP}', file=out, flush=True)
        session = pipe.new_session(system)
        while True:
            line = _read('\n>>> ')
            if line is None or line.strip() == '/exit':
                break
            message = line.strip()
            if not message:
                continue
            if message == '/reset':
                pipe.end_session(session)
                session = pipe.new_session(system)
                print('(new conversation)', file=out, flush=True)
                continue
            try:
                for r in pipe.stream_chat(message, session, gen_config):
                    out.write(r.text)
                    out.flush()
                    last = r
                if last.finish_reason == 'length':
                    out.write(' [stopped: max_new_tokens or session_len reached; /reset to start over]')
                out.write('\n')
                out.flush()
            except ValueError as e:  # e.g. the conversation outgrew session_len
                print(f'\nlmd: {e}. Type /reset to start a new conversation.', file=out, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        pipe.close()
