"""``/v1/completions``: raw prompts (text or token ids, one or many) and their ``n`` answers each."""
from __future__ import annotations

import secrets
import time

from fastapi import Request

from lmd.async_engine import AsyncEngine
from lmd.messages import Response

from .errors import APIError, as_api_error
from .openai_protocol import CompletionRequest
from .server import Server
from .streaming import (
    RequestTimer,
    Usage,
    merge_streams,
    rejoin,
    run_answers,
    split_first,
    sse_response,
    until_done,
)


async def answer_completions(request: Request, server: Server, engine: AsyncEngine, body: CompletionRequest):
    """The route: each prompt's ``n`` answers, interleaved in one SSE stream or gathered in one body.

    ``echo`` with ``logprobs`` puts the prompt tokens' logprobs before the generated ones, the first
    null (OpenAI's and vLLM's answer, what lm-evaluation-harness scores with); vLLM's
    ``prompt_logprobs`` adds them to each choice in its own shape. Either has the engine compute them
    in the prefill; ``max_tokens: 0`` then scores the prompt alone."""
    if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise APIError(400, 'max_tokens 0 generates nothing: it is for scoring the prompt, with echo (and '
                            'logprobs) or prompt_logprobs', param='max_tokens')
    prompts = completion_prompts(engine, body.prompt)
    timer = RequestTimer(server.metrics, body.n * len(prompts))
    response_format = body.response_format.to_generation_format() if body.response_format else None
    gens = [server.gen_config(body, body.max_tokens, len(ids), body.logprobs, response_format) for ids in prompts]
    prompt_k = max((k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None),
                   default=None)
    if prompt_k is not None:
        gens = [g.replace(prompt_logprobs=prompt_k) for g in gens]
    adapter = server.check_model(body.model)
    streams = [run_answers(server, engine, ids, g, body.session_id if len(prompts) == 1 else None,
                           prompt_param='prompt' if len(prompts) == 1 else f'prompt.{i}', adapter=adapter)
               for i, (ids, g) in enumerate(zip(prompts, gens))]
    rid = f'cmpl-{secrets.token_hex(12)}'
    echo = [engine.decode(ids, skip_special_tokens=False) if not isinstance(body.prompt, str)
            else body.prompt for ids in prompts] if body.echo else None
    ctx = CompletionStream(server, body, rid, echo, timer, n=body.n, prompts=prompts)
    merged = merge_streams(streams)
    if body.stream:
        return await sse_response(request, server, timer, merged, ctx)
    return await until_done(request, completion_whole(ctx, merged), timer)


def completion_prompts(engine: AsyncEngine, prompt) -> list[list[int]]:
    vocab = engine.model_info.vocab_size
    if isinstance(prompt, str):
        rows = [engine.encode_text(prompt)]
    elif isinstance(prompt[0], str):
        rows = [engine.encode_text(p) for p in prompt]
    elif isinstance(prompt[0], int):
        rows = [list(prompt)]
    else:
        rows = [list(p) for p in prompt]
    for i, row in enumerate(rows):
        if not row:
            raise APIError(400, 'the prompt is empty', param='prompt')
        if max(row) >= vocab:
            raise APIError(400, f'token id {max(row)} is outside the vocabulary [0, {vocab})', param='prompt')
    return rows


# ---- completions -----------------------------------------------------------------------------------------

class CompletionStream:

    def __init__(self, server: Server, body: CompletionRequest, rid: str, echo: list[str] | None,
                 timer: RequestTimer, n: int, prompts: list[list[int]]):
        self.server, self.body, self.rid, self.echo, self.timer = server, body, rid, echo, timer
        self.n, self.n_prompts, self.prompts = n, len(prompts), prompts
        self.created = int(time.time())
        self.model = server.model_label(body.model)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.usages = [Usage() for _ in range(self.n_prompts)]
        self.offsets = [0] * (n * self.n_prompts)
        self.echoed = [False] * (n * self.n_prompts)
        self.done = 0

    def index(self, k: int, r: Response) -> int:
        return k * self.n + r.index

    def start(self):
        return ()

    def logprobs(self, i: int, token_ids, logprobs) -> dict:
        lp = self.server.token_texts.completion_logprobs(token_ids, logprobs, self.body.logprobs or 0,
                                                         self.offsets[i])
        if lp['text_offset']:
            self.offsets[i] = lp['text_offset'][-1] + len(lp['tokens'][-1])
        return lp

    def feed(self, item: tuple[int, Response]):
        k, r = item
        i = self.index(k, r)
        self.usages[k].add(r.index, r)
        self.timer.token(r.generate_token_len)
        text = r.text
        texts = self.server.token_texts
        lp = None
        if self.echo is not None and not self.echoed[i]:  # the first piece: the prompt, and its logprobs
            self.echoed[i] = True
            text = self.echo[k] + text
            if self.body.logprobs is not None:
                lp = texts.echo_logprobs(self.prompts[k], r.prompt_logprobs, self.body.logprobs)
                self.offsets[i] = len(self.echo[k])  # the answer's offsets count from the echoed prompt's end
        if self.body.logprobs is not None and r.logprobs:
            answer = self.logprobs(i, r.token_ids, r.logprobs)
            lp = answer if lp is None else {key: lp[key] + answer[key] for key in lp}
        if r.finish_reason is not None:
            self.done += 1
            self.timer.done(r.generate_token_len, r.input_token_len, r.finish_reason)
        if not text and lp is None and r.finish_reason is None:
            return
        choice = {'index': i, 'text': text, 'logprobs': lp, 'finish_reason': r.finish_reason}
        if self.body.prompt_logprobs is not None and r.prompt_logprobs is not None:
            choice['prompt_logprobs'] = texts.prompt_logprobs(self.prompts[k], r.prompt_logprobs,
                                                              self.body.prompt_logprobs)
        chunk = {'id': self.rid, 'object': 'text_completion', 'created': self.created, 'model': self.model,
                 'choices': [choice]}
        if self.include_usage:
            chunk['usage'] = None
        yield chunk

    def usage(self) -> dict:
        p = sum(u.prompt_tokens for u in self.usages)
        c = sum(sum(u.completion.values()) for u in self.usages)
        return {'prompt_tokens': p, 'completion_tokens': c, 'total_tokens': p + c,
                'prompt_tokens_details': {'cached_tokens': sum(u.cached_tokens for u in self.usages)}}

    def finish(self):
        if self.include_usage:
            yield {'id': self.rid, 'object': 'text_completion', 'created': self.created, 'model': self.model,
                   'choices': [], 'usage': self.usage()}


async def completion_whole(ctx: CompletionStream, merged):
    try:
        first, agen = await split_first(merged)
    except Exception as e:
        raise as_api_error(e) from e
    ctx.timer.accepted()
    total = ctx.n * ctx.n_prompts
    texts = [[] for _ in range(total)]
    lps: list[dict | None] = [None] * total
    prompt_lps: list[list | None] = [None] * total
    finish = ['stop'] * total
    try:
        async for item in rejoin(first, agen):
            for chunk in ctx.feed(item):
                ch = chunk['choices'][0]
                i = ch['index']
                texts[i].append(ch['text'])
                if ch['logprobs'] is not None:
                    if lps[i] is None:
                        lps[i] = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
                    for key in lps[i]:
                        lps[i][key].extend(ch['logprobs'][key])
                if ch['finish_reason'] is not None:
                    finish[i] = ch['finish_reason']
                if 'prompt_logprobs' in ch:
                    prompt_lps[i] = ch['prompt_logprobs']
    except Exception as e:
        raise as_api_error(e) from e
    finally:
        await agen.aclose()
    if ctx.body.logprobs is not None:
        empty = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
        lps = [lp or dict(empty) for lp in lps]
    choices = [{'index': i, 'text': ''.join(texts[i]), 'logprobs': lps[i], 'finish_reason': finish[i]}
               for i in range(total)]
    if ctx.body.prompt_logprobs is not None:  # vLLM's extra, on each choice
        for choice, plp in zip(choices, prompt_lps):
            choice['prompt_logprobs'] = plp
    return {'id': ctx.rid, 'object': 'text_completion', 'created': ctx.created, 'model': ctx.model,
            'choices': choices, 'usage': ctx.usage()}
