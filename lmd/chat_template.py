"""Chat templates: the model's own Jinja template, or a named built-in, turning messages into a prompt.

A template renders OpenAI-style messages (``to_messages`` validates them) into
the prompt text and says which strings end an answer (``stop_words``). A
rendered prompt carries its own BOS text where the model wants one (as HF
templates do with ``{{ bos_token }}``), so it is encoded without adding special
tokens.

Tools (OpenAI ``tools``) reach a Jinja template as ``tools`` in HF's shape
(``[{"type": "function", "function": {...}}]``), and assistant ``tool_calls``
arguments as dicts, as HF templates expect. A built-in template, or a Jinja one
that never mentions ``tools``, writes them itself in its family's format (see
``TOOL_STYLES``): the tool list in the system prompt, the assistant's calls and
the tool results as the model family writes them, so the matching
``--tool-call-parser`` reads the answer.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .messages import ChatTemplateConfig
    from .tokenizer import Tokenizer

ROLES = ('system', 'user', 'assistant', 'tool')


def to_messages(prompt: str | Sequence[dict]) -> list[dict]:
    """A prompt as a list of ``{'role', 'content'}`` dicts with string content.

    A plain string is one user message. Content given as OpenAI parts
    (``[{'type': 'text', 'text': ...}]``) is joined into one string. Other keys of
    a message (``name``, ``tool_calls``...) are kept. Bad input raises
    ``ValueError`` naming the message index and field.
    """
    if isinstance(prompt, str):
        return [{'role': 'user', 'content': prompt}]
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f'prompt must be a string or a list of messages, got {type(prompt).__name__}')
    if not prompt:
        raise ValueError('prompt is an empty list of messages')
    out = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict):
            raise ValueError(f'messages[{i}] must be a dict with "role" and "content", got {type(msg).__name__}')
        role = msg.get('role')
        if role not in ROLES:
            raise ValueError(f'messages[{i}].role={role!r} is invalid: allowed roles are {", ".join(ROLES)}')
        if 'content' not in msg:
            raise ValueError(f'messages[{i}] has no "content"')
        content = msg['content']
        if content is None and role == 'assistant' and msg.get('tool_calls'):
            content = ''
        out.append({**msg, 'content': _content_text(i, content)})
    return out


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get('type') != 'text':
                got = part.get('type') if isinstance(part, dict) else type(part).__name__
                raise ValueError(f'messages[{i}].content[{j}] is invalid: only {{"type": "text", "text": ...}} '
                                 f'parts are supported, got {got!r}')
            if not isinstance(part.get('text'), str):
                raise ValueError(f'messages[{i}].content[{j}].text must be a string, got {part.get("text")!r}')
            texts.append(part['text'])
        return ''.join(texts)
    raise ValueError(f'messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}')


def to_tools(tools: Sequence[dict] | None) -> list[dict] | None:
    """OpenAI ``tools`` as ``[{'type': 'function', 'function': {'name': ..., ...}}]`` (None or [] -> None).

    A bare function (``{'name': ..., 'parameters': ...}``) is wrapped; pydantic models are dumped. Bad
    input raises ``ValueError`` naming the tool's index and field.
    """
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f'tools must be a list of {{"type": "function", "function": {{...}}}}, '
                         f'got {type(tools).__name__}')
    out = []
    for i, tool in enumerate(tools):
        if hasattr(tool, 'model_dump'):
            tool = tool.model_dump(exclude_none=True)
        if not isinstance(tool, dict):
            raise ValueError(f'tools[{i}] must be a dict, got {type(tool).__name__}')
        if 'function' not in tool and 'name' in tool:
            tool = {'type': 'function', 'function': tool}
        if tool.get('type', 'function') != 'function':
            raise ValueError(f'tools[{i}].type={tool.get("type")!r} is invalid: only "function" is supported')
        function = tool.get('function')
        if not isinstance(function, dict) or not isinstance(function.get('name'), str) or not function['name']:
            raise ValueError(f'tools[{i}].function.name must be a non-empty string')
        out.append({**tool, 'type': 'function'})
    return out or None


def tool_calls_of(i: int, msg: dict) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: each ``{'function': {'name', 'arguments'}}``, with
    ``arguments`` as a dict (a JSON text is decoded; one that is not JSON stays a string)."""
    calls = msg.get('tool_calls') or []
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f'messages[{i}].tool_calls must be a list, got {type(calls).__name__}')
    out = []
    for j, call in enumerate(calls):
        function = call.get('function') if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get('name'), str):
            raise ValueError(f'messages[{i}].tool_calls[{j}].function.name must be a string')
        args = function.get('arguments', {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        elif not isinstance(args, dict):
            raise ValueError(f'messages[{i}].tool_calls[{j}].function.arguments must be a JSON string or an '
                             f'object, got {type(args).__name__}')
        out.append({**call, 'type': 'function', 'function': {**function, 'arguments': args}})
    return out


def _check_tool_calls(messages: list[dict]) -> None:
    for i, msg in enumerate(messages):
        if msg['role'] == 'assistant' and msg.get('tool_calls'):
            tool_calls_of(i, msg)


def _args_json(args: dict | str) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """``text`` appended to the system prompt (a new system message when there is none)."""
    if messages and messages[0]['role'] == 'system':
        first = messages[0]
        sep = '\n\n' if first['content'] else ''
        return [{**first, 'content': first['content'] + sep + text}] + messages[1:]
    return [{'role': 'system', 'content': text}] + messages


def _hermes_tools(tools: list[dict]) -> str:
    listed = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ('# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
            'The functions you can call are listed within <tools></tools> XML tags:\n'
            f'<tools>\n{listed}\n</tools>\n\n'
            'For each call, return a JSON object with the function name and its arguments within '
            '<tool_call></tool_call> XML tags:\n'
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _hermes_calls(calls: list[dict]) -> str:
    return '\n'.join('<tool_call>\n' + json.dumps({'name': c['function']['name']}, ensure_ascii=False)[:-1]
                     + ', "arguments": ' + _args_json(c['function']['arguments']) + '}\n</tool_call>'
                     for c in calls)


def _llama3_tools(tools: list[dict]) -> str:
    listed = '\n\n'.join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
    return ('Given the following functions, please respond with a JSON for a function call with its proper '
            'arguments that best answers the given prompt.\n\n'
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            f'value}}. Do not use variables.\n\n{listed}')


def _llama3_calls(calls: list[dict]) -> str:
    return '; '.join(json.dumps({'name': c['function']['name']}, ensure_ascii=False)[:-1]
                     + ', "parameters": ' + _args_json(c['function']['arguments']) + '}' for c in calls)


def _internlm2_calls(calls: list[dict]) -> str:
    return '\n'.join('<|action_start|><|plugin|>\n' + json.dumps({'name': c['function']['name']},
                                                                    ensure_ascii=False)[:-1]
                     + ', "parameters": ' + _args_json(c['function']['arguments']) + '}<|action_end|>'
                     for c in calls)


def _hermes_messages(messages: list[dict], tools: list[dict] | None, results: bool = True) -> list[dict]:
    """Tools, calls and results written into plain messages, as Qwen2.5 and Hermes models read them:
    the tool list in the system prompt, calls as ``<tool_call>`` blocks in the assistant's text, results
    (when ``results``) as a user turn of ``<tool_response>`` blocks (consecutive results share one turn)."""
    if tools:
        messages = _with_system(messages, _hermes_tools(tools))
    out: list[dict] = []
    for i, msg in enumerate(messages):
        if msg['role'] == 'assistant' and msg.get('tool_calls'):
            calls = _hermes_calls(tool_calls_of(i, msg))
            msg = {k: v for k, v in msg.items() if k != 'tool_calls'}
            msg['content'] = (msg['content'] + '\n' if msg['content'] else '') + calls
        elif msg['role'] == 'tool' and results:
            response = f'<tool_response>\n{msg["content"]}\n</tool_response>'
            if out and out[-1].get('_tool_responses'):
                out[-1]['content'] += '\n' + response
                continue
            msg = {'role': 'user', 'content': response, '_tool_responses': True}
        out.append(msg)
    return [{k: v for k, v in m.items() if k != '_tool_responses'} for m in out]


# How a built-in template writes tools: the system prompt text, and the assistant's calls.
TOOL_STYLES = ('hermes', 'llama3', 'internlm2')


class ChatTemplate:
    """Turns messages into a prompt; ``stop_words`` are the strings that end an answer."""
    name: str
    stop_words: list[str]

    def render(self, messages: str | Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None, **kwargs) -> str:
        """The prompt text. ``tools``: OpenAI tools (see ``to_tools``); ``kwargs`` reach a Jinja template
        as variables (e.g. ``enable_thinking``) and are ignored by the built-ins."""
        raise NotImplementedError

    def with_default_system(self, system: str | None) -> 'ChatTemplate':
        """The same template with ``system`` as the system prompt used when the messages have none."""
        raise NotImplementedError


@dataclass(frozen=True)
class RoleChatTemplate(ChatTemplate):
    """A template where each message is ``prefix[role] + content + suffix[role]``.

    ``default_system`` is the system prompt put first when the messages bring none. ``tool_style``
    (one of ``TOOL_STYLES``) says how tools, calls and tool results are written: 'hermes' as
    ``_hermes_messages``; 'llama3' lists the functions in the system prompt and writes calls as
    ``{"name": ..., "parameters": ...}`` joined by '; ', results in the 'tool' role's turn (ipython);
    'internlm2' adds a ``system name=<|plugin|>`` turn with the functions and writes calls as
    ``<|action_start|><|plugin|>`` blocks, results as ``environment name=<|plugin|>`` turns.
    """
    name: str
    prefixes: dict
    suffix: str
    generation_prompt: str
    stop_words: list[str]
    begin: str = ''
    default_system: str | None = None
    strip_content: bool = False
    tool_style: str = 'hermes'

    def __post_init__(self):
        if self.tool_style not in TOOL_STYLES:
            raise ValueError(f'tool_style={self.tool_style!r} is invalid: allowed are {", ".join(TOOL_STYLES)}')

    def render(self, messages: str | Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None, **kwargs) -> str:
        messages = to_messages(messages)
        tools = to_tools(tools)
        _check_tool_calls(messages)   # before a default system prompt shifts the indices
        if self.default_system is not None and messages[0]['role'] != 'system':
            messages = [{'role': 'system', 'content': self.default_system}] + messages
        plugin_turn = ''
        if self.tool_style == 'hermes':
            messages = _hermes_messages(messages, tools)
        elif self.tool_style == 'llama3' and tools:
            messages = _with_system(messages, _llama3_tools(tools))
        elif self.tool_style == 'internlm2' and tools:
            listed = json.dumps([t['function'] for t in tools], ensure_ascii=False, indent=4)
            plugin_turn = f'<|im_start|>system name=<|plugin|>\n{listed}{self.suffix}'
        parts = [self.begin]
        for i, msg in enumerate(messages):
            if plugin_turn and msg['role'] != 'system':  # the functions follow the system prompt
                parts.append(plugin_turn)
                plugin_turn = ''
            content = msg['content'].strip() if self.strip_content else msg['content']
            if msg['role'] == 'assistant' and msg.get('tool_calls'):
                calls = tool_calls_of(i, msg)
                if self.tool_style == 'llama3':
                    content = (content + '\n' if content else '') + _llama3_calls(calls)
                elif self.tool_style == 'internlm2':
                    content += _internlm2_calls(calls)
            parts.append(self.prefixes[msg['role']] + content + self.suffix)
        if plugin_turn:
            parts.append(plugin_turn)
        if add_generation_prompt:
            parts.append(self.generation_prompt)
        return ''.join(parts)

    def with_default_system(self, system: str | None) -> 'RoleChatTemplate':
        return dataclasses.replace(self, default_system=system)


def _chatml(name: str, default_system: str | None, stop_words: list[str]) -> RoleChatTemplate:
    return RoleChatTemplate(
        name=name,
        prefixes={role: f'<|im_start|>{role}\n' for role in ROLES},
        suffix='<|im_end|>\n',
        generation_prompt='<|im_start|>assistant\n',
        stop_words=stop_words,
        default_system=default_system,
    )


INTERNLM2_META_INSTRUCTION = (
    'You are an AI assistant whose name is InternLM (书生·浦语).\n'
    '- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory '
    '(上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n'
    '- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the user such '
    'as English and 中文.')

BUILTIN_TEMPLATES: dict[str, ChatTemplate] = {
    'chatml': _chatml('chatml', None, ['<|im_end|>']),
    'qwen2': _chatml('qwen2', 'You are a helpful assistant.', ['<|im_end|>', '<|endoftext|>']),
    'internlm2': dataclasses.replace(
        _chatml('internlm2', INTERNLM2_META_INSTRUCTION, ['<|im_end|>', '<|action_end|>']), begin='<s>',
        prefixes={**{role: f'<|im_start|>{role}\n' for role in ROLES},
                  'tool': '<|im_start|>environment name=<|plugin|>\n'},
        tool_style='internlm2'),
    'llama3': RoleChatTemplate(
        name='llama3',
        prefixes={role: f'<|start_header_id|>{"ipython" if role == "tool" else role}<|end_header_id|>\n\n'
                  for role in ROLES},
        suffix='<|eot_id|>',
        generation_prompt='<|start_header_id|>assistant<|end_header_id|>\n\n',
        stop_words=['<|eot_id|>', '<|end_of_text|>'],
        begin='<|begin_of_text|>',
        strip_content=True,  # as Meta's template does (`message['content'] | trim`)
        tool_style='llama3',
    ),
    # Base (non-chat) models: the contents as they are, no roles.
    'base': RoleChatTemplate(name='base', prefixes={role: '' for role in ROLES}, suffix='',
                             generation_prompt='', stop_words=[]),
}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it
        renders its body unchanged."""
        tags = {'generation'}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method('_render_body'), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters['tojson'] = _tojson
    env.globals['raise_exception'] = _raise_exception
    env.globals['strftime_now'] = lambda fmt: datetime.now().strftime(fmt)
    return env


class JinjaChatTemplate(ChatTemplate):
    """A model's own Jinja chat template, rendered as ``transformers``' ``apply_chat_template`` does.

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token``,
    ``eos_token``, ``tools`` and any extra keyword. ``stop_words`` hold the eos
    token text and any ``extra_stop_words``.

    A template whose text never says ``tools`` cannot show them: the tools, calls and
    tool results are then written into the messages in the Hermes style
    (``_hermes_messages``). One that never says ``tool_calls`` gets the assistant's
    calls written into its content the same way.
    """

    def __init__(self, template_str: str, bos_token: str | None = None, eos_token: str | None = None,
                 extra_stop_words: Sequence[str] = (), default_system: str | None = None, name: str = 'jinja'):
        import jinja2
        try:
            self._template = _jinja_env().from_string(template_str)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f'the chat template is not valid Jinja (line {e.lineno}): {e.message}') from e
        self.template_str = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.default_system = default_system
        self.name = name
        self.knows_tools = re.search(r'\btools\b', template_str) is not None
        self.knows_tool_calls = re.search(r'\btool_calls\b', template_str) is not None
        self._extra_stop_words = list(extra_stop_words)
        self.stop_words = list(dict.fromkeys([w for w in [eos_token, *extra_stop_words] if w]))

    def render(self, messages: str | Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None, **kwargs) -> str:
        import jinja2
        messages = to_messages(messages)
        tools = to_tools(tools)
        _check_tool_calls(messages)   # before a default system prompt shifts the indices
        if self.default_system is not None and messages[0]['role'] != 'system':
            messages = [{'role': 'system', 'content': self.default_system}] + messages
        if not self.knows_tools:
            messages, tools = _hermes_messages(messages, tools), None
        elif not self.knows_tool_calls:
            messages = _hermes_messages(messages, None, results=False)
        else:  # HF templates take a call's arguments as a dict
            messages = [{**m, 'tool_calls': tool_calls_of(i, m)} if m['role'] == 'assistant' and m.get('tool_calls')
                        else m for i, m in enumerate(messages)]
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or '', eos_token=self.eos_token or '',
                                         tools=tools, **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f'the chat template failed to render these messages: {e}') from e

    def with_default_system(self, system: str | None) -> 'JinjaChatTemplate':
        return JinjaChatTemplate(self.template_str, self.bos_token, self.eos_token, self._extra_stop_words,
                                 system, self.name)

    def __repr__(self):
        return f'JinjaChatTemplate(name={self.name!r}, stop_words={self.stop_words!r})'


def _special_texts(tokenizer: 'Tokenizer', ids: Sequence[int]) -> list[str]:
    special = set(tokenizer.all_special_ids)
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids if i in special]


def _base_for(tokenizer: 'Tokenizer') -> RoleChatTemplate:
    # The prompt is encoded without special tokens, so 'base' writes the BOS a tokenizer would add.
    base = BUILTIN_TEMPLATES['base']
    if tokenizer.add_bos_token and tokenizer.bos_token:
        base = dataclasses.replace(base, begin=tokenizer.bos_token)
    return base


def get_chat_template(tokenizer: 'Tokenizer', config: 'ChatTemplateConfig | None' = None) -> ChatTemplate:
    """The template a model's prompts go through.

    Without a config: the model's own Jinja template, or 'base' when it has none.
    With one: the named built-in; ``config.meta_instruction`` (else ``config.system``)
    replaces its default system prompt, and ``config.chat_template`` replaces the
    built-in's format with a custom Jinja string (keeping the built-in's stop words).
    """
    eos_texts = _special_texts(tokenizer, tokenizer.eos_token_ids)
    if config is None:
        if tokenizer.chat_template:
            return JinjaChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                                     extra_stop_words=eos_texts, name='model')
        return _base_for(tokenizer)
    builtin = _base_for(tokenizer) if config.model_name == 'base' else BUILTIN_TEMPLATES[config.model_name]
    template = builtin
    if config.chat_template:
        template = JinjaChatTemplate(config.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                                     extra_stop_words=[*builtin.stop_words, *eos_texts], name=config.model_name)
    system = config.meta_instruction if config.meta_instruction is not None else config.system
    if system is not None:
        template = template.with_default_system(system)
    return template
