"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

Evaluation harnesses count tokens through them with the server's own tokenizer (lm-evaluation-harness'
remote tokenizer reads ``/tokenizer_info`` for the special tokens and chat template, then tokenizes
every request through ``/tokenize``), so the ids they send back in ``/v1/completions`` are the ones the
engine would have made. LMDeploy's ``/v1/encode`` and ``/v1/decode`` stay beside them.
"""
from __future__ import annotations

from lmd.async_engine import AsyncEngine
from lmd.chat_template import to_messages

from .errors import APIError
from .openai_protocol import DetokenizeRequest, TokenizeRequest


def tokenize(engine: AsyncEngine, body: TokenizeRequest) -> dict:
    """``{count, max_model_len, tokens[, token_strs]}`` of a prompt, or of chat messages as the template
    renders them."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, 'send exactly one of prompt (a text) and messages (a chat)',
                       param='messages' if body.messages is not None else 'prompt')
    if body.prompt is not None:
        for name in ('tools', 'chat_template_kwargs'):
            if getattr(body, name) is not None:
                raise APIError(400, f'{name} is for messages; a prompt is tokenized as it is', param=name)
        ids = engine.encode_text(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        text = render_chat(engine, body)
        # a rendered template carries its own BOS where the model wants one
        ids = engine.encode_text(text, add_special_tokens=bool(body.add_special_tokens))
    out = {'count': len(ids), 'max_model_len': engine.session_len, 'tokens': ids}
    if body.return_token_strs:
        out['token_strs'] = engine.tokenizer.hf_tokenizer.convert_ids_to_tokens(ids)
    return out


def render_chat(engine: AsyncEngine, body: TokenizeRequest) -> str:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        messages = to_messages(body.messages)
        return engine.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
                                           **(body.chat_template_kwargs or {}))
    except TypeError as e:
        raise APIError(400, f'the chat template does not take these arguments: {e}',
                       param='chat_template_kwargs') from e
    except ValueError as e:
        raise APIError(400, str(e), param='messages') from e


def check_in_vocab(engine: AsyncEngine, ids: list[int], param: str) -> None:
    """A 400 naming ``param`` for the first id past the vocabulary (negative ids the schema refuses)."""
    vocab = engine.model_info.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f'token id {bad} is outside the vocabulary [0, {vocab})', param=param)


def detokenize(engine: AsyncEngine, body: DetokenizeRequest) -> dict:
    """``{prompt}``: the text of the ids, special tokens kept (vLLM's answer)."""
    check_in_vocab(engine, body.tokens, 'tokens')
    return {'prompt': engine.decode(body.tokens, skip_special_tokens=False)}


def tokenizer_info(engine: AsyncEngine) -> dict:
    """What a remote tokenizer needs (tokenizer_config.json's fields, as vLLM answers): the special
    tokens as text, whether a BOS is added, the longest context, and the chat template the server
    renders with (null for a built-in one, which is not Jinja)."""
    tok = engine.tokenizer
    hf = tok.hf_tokenizer
    return {'tokenizer_class': type(hf).__name__, 'bos_token': tok.bos_token, 'eos_token': tok.eos_token,
            'pad_token': hf.pad_token, 'unk_token': hf.unk_token, 'add_bos_token': tok.add_bos_token,
            'vocab_size': tok.vocab_size, 'model_max_length': engine.session_len,
            'chat_template': getattr(engine.chat_template, 'template_str', None)}
