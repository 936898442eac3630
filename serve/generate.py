"""LMDeploy's ``/generate``: a raw prompt or token ids, optionally an interactive session whose KV
cache the engine keeps between requests."""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmd.async_engine import AsyncEngine
from lmd.errors import PromptTooLongError
from lmd.messages import GenerationConfig, Response

from .errors import APIError, as_api_error
from .openai_protocol import GenerateRequest
from .server import Server, max_new_tokens
from .streaming import MAX_USER_SESSION_ID, RequestTimer, rejoin, split_first, until_done


async def run_generate(request: Request, server: Server, engine: AsyncEngine, body: GenerateRequest):
    sid = body.session_id
    if sid > MAX_USER_SESSION_ID:
        raise APIError(400, f'session_id must be at most {MAX_USER_SESSION_ID}', param='session_id')
    if body.cancel:
        if sid >= 0:
            engine.abort(sid)
            if server.sessions.pop(sid, None) is not None:
                engine.end(sid)
        return {'text': '', 'tokens': 0, 'input_tokens': 0, 'history_tokens': 0, 'finish_reason': 'abort'}
    continuing = sid >= 0 and server.sessions.get(sid, False)
    if body.input_ids is not None:
        ids = list(body.input_ids)
        if max(ids) >= engine.model_info.vocab_size:
            raise APIError(400, f'token id {max(ids)} is outside the vocabulary '
                                f'[0, {engine.model_info.vocab_size})', param='input_ids')
    elif body.do_preprocess:
        ids = engine.encode(body.prompt, do_preprocess=True)
    else:
        ids = engine.encode_text(body.prompt, add_special_tokens=not continuing)
    if not ids:
        raise APIError(400, 'the prompt is empty', param='prompt')
    max_tokens = body.max_tokens or body.request_output_len
    # checked against this request's tokens: a kept session's history is the engine's to count (it ends
    # the turn at session_len)
    max_new = max_new_tokens(engine.session_len, len(ids), max_tokens,
                             'max_tokens' if body.max_tokens else 'request_output_len')
    try:
        gen = GenerationConfig(max_new_tokens=max_new,
                               min_new_tokens=body.min_new_tokens if body.min_new_tokens <= max_new else 0,
                               do_sample=body.temperature > 0, temperature=body.temperature, top_p=body.top_p,
                               top_k=max(body.top_k, 0), min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                               ignore_eos=body.ignore_eos, random_seed=body.seed, stop_words=body.stop,
                               skip_special_tokens=body.skip_special_tokens,
                               spaces_between_special_tokens=body.spaces_between_special_tokens,
                               logprobs=1 if body.return_logprobs else None)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    kwargs: dict[str, Any] = {}
    if sid >= 0:
        kwargs = dict(session_id=sid, sequence_start=not continuing, sequence_end=not body.interactive_mode)
    if body.adapter_name is not None:
        kwargs['adapter_name'] = server.check_model(body.adapter_name)
    timer = RequestTimer(server.metrics)

    async def stream():
        ok = False
        try:
            async with server.slot():
                async for r in engine.generate(None, gen_config=gen, input_ids=ids, **kwargs):
                    yield r
            ok = True
        except PromptTooLongError as e:
            raise as_api_error(e, 'input_ids' if body.input_ids is not None else 'prompt') from e
        finally:
            if sid >= 0:
                if ok and body.interactive_mode:
                    server.sessions[sid] = True
                else:
                    if server.sessions.pop(sid, None) is not None and not ok:
                        engine.end(sid)

    def piece(r: Response) -> dict:
        out = {'text': r.text, 'tokens': r.generate_token_len, 'input_tokens': r.input_token_len,
               'history_tokens': r.input_token_len - len(ids), 'finish_reason': r.finish_reason}
        if body.return_logprobs:
            out['logprobs'] = [{str(k): v for k, v in d.items()} for d in (r.logprobs or [])]
            out['token_ids'] = list(r.token_ids)
        return out

    try:
        first, agen = await split_first(stream())
    except Exception as e:
        raise as_api_error(e) from e
    timer.accepted()
    if body.stream:
        async def lines():
            try:
                async for r in rejoin(first, agen):
                    timer.token(r.generate_token_len)
                    if r.finish_reason is not None:
                        timer.done(r.generate_token_len, r.input_token_len, r.finish_reason)
                    yield json.dumps(piece(r), ensure_ascii=False) + '\n'
            except Exception as e:
                yield json.dumps(as_api_error(e).body()) + '\n'
            finally:
                timer.abandoned()  # a no-op after the last answer
                await agen.aclose()
        return StreamingResponse(lines(), media_type='application/x-ndjson')

    async def whole():
        pieces, last, all_ids, lps = [], None, [], []
        try:
            async for r in rejoin(first, agen):
                timer.token(r.generate_token_len)
                pieces.append(r.text)
                all_ids.extend(r.token_ids)
                lps.extend(r.logprobs or [])
                last = r
        except Exception as e:
            raise as_api_error(e) from e
        finally:
            await agen.aclose()
        timer.done(last.generate_token_len, last.input_token_len, last.finish_reason)
        out = piece(last)
        out['text'] = ''.join(pieces)
        if body.return_logprobs:
            out['token_ids'] = all_ids
            out['logprobs'] = [{str(k): v for k, v in d.items()} for d in lps]
        return out

    return await until_done(request, whole(), timer)
