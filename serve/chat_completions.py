"""``/v1/chat/completions``: the prompt (``AsyncEngine.encode_chat`` with the tools, the grammar
a forced tool choice implies) and the engine's output as OpenAI's chunks or body (reasoning, then
tool calls)."""
from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from lmd.async_engine import AsyncEngine
from lmd.messages import Response

from .errors import APIError, as_api_error
from .openai_protocol import ChatCompletionRequest, ToolChoiceFunction
from .server import Server
from .streaming import ChoiceState, RequestTimer, Usage, rejoin, run_answers, split_first, sse_response, until_done


async def answer_chat(request: Request, server: Server, engine: AsyncEngine, body: ChatCompletionRequest):
    """The route: one chat's ``n`` answers, streamed as SSE chunks or as one body."""
    timer = RequestTimer(server.metrics, body.n)
    prep = prepare_chat(server, engine, body)
    gen = server.gen_config(body, body.max_completion_tokens or body.max_tokens, len(prep.input_ids),
                            (body.top_logprobs or 0) if body.logprobs else None, prep.response_format)
    if body.prompt_logprobs is not None:  # vLLM's extra: the prompt's own, from the prefill
        gen = gen.replace(prompt_logprobs=body.prompt_logprobs)
    rid = f'chatcmpl-{secrets.token_hex(12)}'
    stream = run_answers(server, engine, prep.input_ids, gen, body.session_id, prompt_param='messages',
                         adapter=server.check_model(body.model))
    try:
        if body.stream:
            return await sse_response(request, server, timer, stream, ChatStream(server, body, prep, rid, timer))
        return await until_done(request, chat_whole(server, body, prep, rid, stream, timer), timer)
    except APIError as e:
        raise prep.blame(e) from None


@dataclass
class ChatPrep:
    input_ids: list[int]
    response_format: dict | None
    forced_tool: str | None = None      # tool_choice names a function: the output is its arguments
    required_tools: bool = False        # tool_choice 'required': the output is a JSON list of calls
    parse_tools: bool = False           # tool_choice 'auto' with a parser
    prompt_text: str | None = None      # the rendered prompt (a reasoning parser reads how it ends)
    # where the grammar came from when not from response_format: (the path lmd.guided names, the request field)
    format_source: tuple[str, str] | None = None

    def blame(self, e: APIError) -> APIError:
        """``e`` naming the request field the client sent, when lmd.guided blamed the response_format
        the server built from it (``regex``, ``guided_json``, a tool's ``parameters``)."""
        if self.format_source is None or not (e.param or '').startswith(self.format_source[0]):
            return e
        path, field = self.format_source
        param = e.param
        if self.required_tools:  # the combined schema's items.anyOf[i] is tools[i]
            m = re.match(re.escape(path) + r'\.items\.anyOf\[(\d+)\]\.properties\.parameters', param)
            path, field = (m.group(0), f'tools.{m.group(1)}.function.parameters') if m else (path, field)
        new = field + param[len(path):]
        return APIError(e.status, e.message.replace(param, new, 1), param=new, type_=e.type, code=e.code)


def _tool_schema_required(tools) -> dict:
    return {'type': 'array', 'minItems': 1, 'items': {'anyOf': [
        {'type': 'object', 'properties': {'name': {'type': 'string', 'enum': [t.function.name]},
                                          'parameters': t.function.parameters or {'type': 'object'}},
         'required': ['name', 'parameters']} for t in tools]}}


def prepare_chat(server: Server, engine: AsyncEngine, body: ChatCompletionRequest) -> ChatPrep:
    response_format = body.response_format.to_generation_format() if body.response_format else None
    prep = ChatPrep(input_ids=[], response_format=response_format)
    if body.regex is not None:
        prep.response_format = {'type': 'regex_schema', 'regex_schema': body.regex}
        prep.format_source = ('response_format.regex_schema', 'regex')
    if body.guided_json is not None:
        prep.response_format = {'type': 'json_schema', 'json_schema': {'name': 'guided_json',
                                                                       'schema': body.guided_json}}
        prep.format_source = ('response_format.json_schema.schema', 'guided_json')
    tools = body.tools if body.tool_choice != 'none' else None
    if tools:
        if prep.response_format is not None:
            field = prep.format_source[1] if prep.format_source else 'response_format'
            raise APIError(400, f'tools cannot be combined with {field}', param=field)
        choice = body.tool_choice or 'auto'
        if isinstance(choice, ToolChoiceFunction):
            i, fn = next((i, t.function) for i, t in enumerate(tools) if t.function.name == choice.function.name)
            prep.forced_tool = fn.name
            prep.response_format = {'type': 'json_schema', 'json_schema': {
                'name': fn.name, 'schema': fn.parameters or {'type': 'object'}}}
            prep.format_source = ('response_format.json_schema.schema', f'tools.{i}.function.parameters')
        elif choice == 'required':
            prep.required_tools = True
            prep.response_format = {'type': 'json_schema', 'json_schema': {
                'name': 'tool_calls', 'schema': _tool_schema_required(tools)}}
            prep.format_source = ('response_format.json_schema.schema', 'tools')
        else:  # 'auto', OpenAI's default: read by --tool-call-parser's parser, else the template's (Server)
            prep.parse_tools = True
    try:
        prompt = engine.encode_chat(body.messages, do_preprocess=body.do_preprocess,
                                    tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                                    chat_template_kwargs=body.chat_template_kwargs)
    except TypeError as e:
        raise APIError(400, f'the chat template does not take these arguments: {e}',
                       param='chat_template_kwargs') from e
    except ValueError as e:
        raise APIError(400, str(e), param='messages') from e
    prep.input_ids, prep.prompt_text = list(prompt.input_ids), prompt.text
    # parsers whose markers are special tokens need them kept in the text
    if prep.parse_tools:
        server.tool_parser_cls(engine.tokenizer).adjust_request(body)
    if server.reasoning_parser_cls is not None:
        server.reasoning_parser_cls(engine.tokenizer, prompt=prep.prompt_text).adjust_request(body)
    return prep


# ---- chat: turning engine output into OpenAI chunks -------------------------------------------------------

class ChatStream:
    """Builds chat.completion.chunk objects from one request's merged engine outputs."""

    def __init__(self, server: Server, body: ChatCompletionRequest, prep: ChatPrep, rid: str, timer: RequestTimer):
        self.server, self.body, self.prep, self.rid, self.timer = server, body, prep, rid, timer
        self.created = int(time.time())
        self.model = server.model_label(body.model)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        self.usage = Usage()
        self.choices = [ChoiceState(i) for i in range(body.n)]
        for c in self.choices:
            if server.reasoning_parser_cls is not None:
                c.reasoning = server.reasoning_parser_cls(server.engine.tokenizer, prompt=prep.prompt_text)
            if prep.parse_tools:
                c.tools = server.tool_parser_cls(server.engine.tokenizer)

    def _chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        chunk = {'id': self.rid, 'object': 'chat.completion.chunk', 'created': self.created, 'model': self.model,
                 'choices': [{'index': index, 'delta': delta, 'logprobs': logprobs,
                              'finish_reason': finish_reason}]}
        if self.include_usage:
            chunk['usage'] = self.usage.body() if self.continuous_usage else None
        return chunk

    def start(self):
        for c in self.choices:
            c.sent_role = True
            yield self._chunk(c.index, {'role': 'assistant', 'content': ''})

    def feed(self, r: Response):
        c = self.choices[r.index]
        self.usage.add(r.index, r)
        self.timer.token(r.generate_token_len)
        logprobs = None
        if self.body.logprobs and r.logprobs:
            logprobs = {'content': self.server.token_texts.chat_logprobs(r.token_ids, r.logprobs,
                                                                          self.body.top_logprobs or 0)}
        deltas = self._deltas(c, r.text, final=r.finish_reason is not None)
        finish = None
        if r.finish_reason is not None:
            c.finish_reason = r.finish_reason
            c.num_tokens = r.generate_token_len
            finish = self._finish_reason(c)
            self.timer.done(r.generate_token_len, r.input_token_len, finish)
        if not deltas and (logprobs is not None or finish is not None):
            deltas = [{}]
        for k, d in enumerate(deltas):
            last = k == len(deltas) - 1
            yield self._chunk(c.index, d, finish if last else None, logprobs if k == 0 else None)

    def _deltas(self, c: ChoiceState, text: str, final: bool) -> list[dict]:
        """The delta objects for a new piece of text of choice ``c``."""
        c.text.append(text)
        prep = self.prep
        if prep.forced_tool:  # the text is the arguments of the named function
            out = []
            if c.forced_call_id is None:
                c.forced_call_id = f'call_{secrets.token_hex(12)}'
                out.append({'tool_calls': [{'index': 0, 'id': c.forced_call_id, 'type': 'function',
                                            'function': {'name': prep.forced_tool, 'arguments': ''}}]})
            if text:
                out.append({'tool_calls': [{'index': 0, 'function': {'arguments': text}}]})
            return out
        if prep.required_tools:  # a JSON list: sent whole once it is complete
            if not final:
                return []
            calls = _parse_required_calls(''.join(c.text))
            return [{'tool_calls': [dict(call, index=i) for i, call in enumerate(calls)]}] if calls else \
                [{'content': ''.join(c.text)}]
        deltas = []
        content = text
        if c.reasoning is not None:
            reasoning, content = c.reasoning.feed(text)
            if final:
                r2, c2 = c.reasoning.finish()
                reasoning, content = reasoning + r2, content + c2
            if reasoning:
                deltas.append({'reasoning_content': reasoning})
        if c.tools is not None:
            pieces = []
            if content:
                d = c.tools.extract_tool_calls_streaming(content)
                if d is not None:
                    pieces.append(d)
            if final:
                d = c.tools.finish()
                if d is not None:
                    pieces.append(d)
            for d in pieces:
                deltas.extend(_tool_delta_dicts(d))
        elif content:
            deltas.append({'content': content})
        return deltas

    def _finish_reason(self, c: ChoiceState) -> str:
        if c.finish_reason in ('stop', 'length'):
            if self.prep.forced_tool or (self.prep.required_tools and c.finish_reason == 'stop'):
                return 'tool_calls'
            if c.tools is not None and c.tools.has_tool_calls() and c.finish_reason == 'stop':
                return 'tool_calls'
        return c.finish_reason or 'stop'

    def finish(self):
        if self.include_usage:
            yield {'id': self.rid, 'object': 'chat.completion.chunk', 'created': self.created, 'model': self.model,
                   'choices': [], 'usage': self.usage.body()}


def _tool_delta_dicts(d) -> list[dict]:
    """A tool parser's DeltaMessage as OpenAI delta dicts."""
    out = {}
    if getattr(d, 'content', None):
        out['content'] = d.content
    calls = getattr(d, 'tool_calls', None)
    if calls:
        out['tool_calls'] = [call if isinstance(call, dict) else call.to_dict() for call in calls]
    return [out] if out else []


def _parse_required_calls(text: str) -> list[dict]:
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    out = []
    for call in calls if isinstance(calls, list) else []:
        if isinstance(call, dict) and 'name' in call:
            out.append({'id': f'call_{secrets.token_hex(12)}', 'type': 'function',
                        'function': {'name': call['name'],
                                     'arguments': json.dumps(call.get('parameters', {}), ensure_ascii=False)}})
    return out


async def chat_whole(server: Server, body: ChatCompletionRequest, prep: ChatPrep, rid: str, stream,
                      timer: RequestTimer):
    """A non-streamed chat completion."""
    try:
        first, agen = await split_first(stream)
    except Exception as e:
        raise as_api_error(e) from e
    timer.accepted()
    usage = Usage()
    choices = [ChoiceState(i) for i in range(body.n)]
    prompt_lps = None
    try:
        async for r in rejoin(first, agen):
            c = choices[r.index]
            if r.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = r.prompt_logprobs
            usage.add(r.index, r)
            timer.token(r.generate_token_len)
            c.text.append(r.text)
            c.token_ids.extend(r.token_ids)
            if r.logprobs:
                c.logprobs.extend(r.logprobs)
            if r.finish_reason is not None:
                c.finish_reason = r.finish_reason
                c.num_tokens = r.generate_token_len
                timer.done(r.generate_token_len, r.input_token_len, r.finish_reason)
    except Exception as e:
        raise as_api_error(e) from e
    finally:
        await agen.aclose()
    out = []
    for c in choices:
        text = ''.join(c.text)
        message: dict[str, Any] = {'role': 'assistant', 'content': text}
        finish = c.finish_reason or 'stop'
        if server.reasoning_parser_cls is not None:
            reasoning, text = server.reasoning_parser_cls(server.engine.tokenizer,
                                                          prompt=prep.prompt_text).extract(text)
            text = text or ''
            message['content'] = text
            message['reasoning_content'] = reasoning
        if prep.forced_tool:
            message['content'] = None
            message['tool_calls'] = [{'id': f'call_{secrets.token_hex(12)}', 'type': 'function',
                                      'function': {'name': prep.forced_tool, 'arguments': text}}]
            finish = 'tool_calls'
        elif prep.required_tools:
            calls = _parse_required_calls(text)
            if calls:
                message['content'] = None
                message['tool_calls'] = calls
                finish = 'tool_calls' if finish == 'stop' else finish
        elif prep.parse_tools:
            parsed = server.tool_parser_cls(server.engine.tokenizer).extract_tool_calls(text)
            if parsed.tool_calls:
                message['content'] = parsed.content or None
                message['tool_calls'] = [call if isinstance(call, dict) else call.to_dict()
                                         for call in parsed.tool_calls]
                finish = 'tool_calls' if finish == 'stop' else finish
        choice = {'index': c.index, 'message': message, 'logprobs': None, 'finish_reason': finish}
        if body.logprobs:
            choice['logprobs'] = {'content': server.token_texts.chat_logprobs(c.token_ids, c.logprobs,
                                                                               body.top_logprobs or 0)}
        out.append(choice)
    result = {'id': rid, 'object': 'chat.completion', 'created': int(time.time()), 'model': server.model_label(body.model),
              'choices': out, 'usage': usage.body()}
    if body.prompt_logprobs is not None:  # vLLM's extra, beside the choices (one prompt for all n)
        result['prompt_logprobs'] = server.token_texts.prompt_logprobs(prep.input_ids, prompt_lps or (),
                                                                       body.prompt_logprobs)
    return result
