"""``lmd serve api_client URL``: a terminal chat against any OpenAI-compatible server.

It speaks through the official ``openai`` client and streams each answer. The
conversation (the system prompt first) is resent every turn, as the protocol
wants. Ctrl-C stops an answer and keeps its part; at the prompt it leaves,
as /exit and Ctrl-D do. A server that is down or refuses the key is one
``lmd: error:`` line, never a traceback.
"""
from __future__ import annotations

import sys

from lmd.errors import LmdError
from lmd.prompt_loop import HELP, read_turns
from lmd.runner import run_command


class ApiClientError(LmdError):
    """The server cannot be used: down, refusing the key, or serving no model."""


def _describe(e: Exception, url: str) -> str:
    from .gradio_app import describe_openai_error
    return describe_openai_error(e, url)


def _connect(api_server_url: str, api_key: str | None, model: str | None):
    """(client, model name); raises ApiClientError when the server cannot be used."""
    import openai

    from .gradio_app import openai_base_url
    client = openai.OpenAI(base_url=openai_base_url(api_server_url), api_key=api_key or 'none', max_retries=0,
                           timeout=openai.Timeout(600.0, connect=10.0))
    try:
        served = [m.id for m in client.models.list().data]
    except openai.OpenAIError as e:
        raise ApiClientError(_describe(e, api_server_url)) from None
    if model is None:
        if not served:
            raise ApiClientError(f'the api_server at {api_server_url} serves no model (/v1/models is empty)')
        model = served[0]
    elif served and model not in served:
        raise ApiClientError(f'model {model!r} is not served at {api_server_url}; it serves: {", ".join(served)}')
    return client, model


def run_api_client(api_server_url: str, *, api_key: str | None = None, model: str | None = None,
                   system: str | None = None, temperature: float = 0.7, top_p: float = 1.0,
                   max_tokens: int = 512) -> None:
    """Chat in the terminal with any OpenAI-compatible server; /reset starts over, /exit (or Ctrl-D) leaves.

    Args:
        api_server_url: the server, http://HOST:PORT (a trailing /v1 is fine).
        api_key: the key the server wants ("Authorization: Bearer KEY").
        model: the model name to ask for (default: the first the server lists).
        system: a system prompt for the conversation.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus sampling mass.
        max_tokens: the most tokens one answer may have.
    """
    import openai

    from .gradio_app import ChatSettings
    ChatSettings(temperature, top_p, max_tokens)  # the same ranges as the Gradio page; raises ValueError
    client, model = _connect(api_server_url, api_key, model)
    out = sys.stdout
    print(f'lmd api_client: {model} at {api_server_url}. {HELP}', file=out, flush=True)
    start = [{'role': 'system', 'content': system}] if system else []
    history = list(start)

    def reset():
        nonlocal history
        history = list(start)

    for message in read_turns(reset, out):
        messages = history + [{'role': 'user', 'content': message}]
        answer, finish_reason = [], None
        try:
            stream = client.chat.completions.create(model=model, messages=messages, stream=True,
                                                    temperature=temperature, top_p=top_p, max_tokens=max_tokens)
            with stream:  # leaving early (Ctrl-C) closes the connection: the server aborts the request
                for chunk in stream:
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    if choice.delta.content:
                        answer.append(choice.delta.content)
                        out.write(choice.delta.content)
                        out.flush()
                    finish_reason = choice.finish_reason or finish_reason
        except KeyboardInterrupt:
            finish_reason = 'interrupted'
        except openai.OpenAIError as e:
            print(f'\nlmd: {_describe(e, api_server_url)}', file=out, flush=True)
            continue  # the message is not part of the conversation
        if finish_reason == 'length':
            out.write(' [stopped: max_tokens reached]')
        elif finish_reason == 'interrupted':
            out.write(' [stopped]')
        out.write('\n')
        out.flush()
        history = messages + [{'role': 'assistant', 'content': ''.join(answer)}]


def main(argv: list[str] | None = None) -> int:
    """``python -m lmd.serve.api_client URL [--api-key] [--model] [--system] [--temperature] [--top-p]
    [--max-tokens]``."""
    return run_command(run_api_client, argv, 'lmd serve api_client')


if __name__ == '__main__':
    raise SystemExit(main())
