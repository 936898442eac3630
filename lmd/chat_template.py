"""Chat templates: the model's own Jinja template, or a named built-in, turning messages into a prompt.

A template renders OpenAI-style messages (``to_messages`` validates them) into
the prompt text and says which strings end an answer (``stop_words``). A
rendered prompt carries its own BOS text where the model wants one (as HF
templates do with ``{{ bos_token }}``), so it is encoded without adding special
tokens.
"""
from __future__ import annotations

import dataclasses
import json
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


class ChatTemplate:
    """Turns messages into a prompt; ``stop_words`` are the strings that end an answer."""
    name: str
    stop_words: list[str]

    def render(self, messages: str | Sequence[dict], add_generation_prompt: bool = True) -> str:
        raise NotImplementedError

    def with_default_system(self, system: str | None) -> 'ChatTemplate':
        """The same template with ``system`` as the system prompt used when the messages have none."""
        raise NotImplementedError


@dataclass(frozen=True)
class RoleChatTemplate(ChatTemplate):
    """A template where each message is ``prefix[role] + content + suffix[role]``.

    ``default_system`` is the system prompt put first when the messages bring none.
    """
    name: str
    prefixes: dict
    suffix: str
    generation_prompt: str
    stop_words: list[str]
    begin: str = ''
    default_system: str | None = None
    strip_content: bool = False

    def render(self, messages: str | Sequence[dict], add_generation_prompt: bool = True) -> str:
        messages = to_messages(messages)
        if self.default_system is not None and messages[0]['role'] != 'system':
            messages = [{'role': 'system', 'content': self.default_system}] + messages
        parts = [self.begin]
        for msg in messages:
            content = msg['content'].strip() if self.strip_content else msg['content']
            parts.append(self.prefixes[msg['role']] + content + self.suffix)
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
    'internlm2': dataclasses.replace(_chatml('internlm2', INTERNLM2_META_INSTRUCTION,
                                             ['<|im_end|>', '<|action_end|>']), begin='<s>'),
    'llama3': RoleChatTemplate(
        name='llama3',
        prefixes={role: f'<|start_header_id|>{"ipython" if role == "tool" else role}<|end_header_id|>\n\n'
                  for role in ROLES},
        suffix='<|eot_id|>',
        generation_prompt='<|start_header_id|>assistant<|end_header_id|>\n\n',
        stop_words=['<|eot_id|>', '<|end_of_text|>'],
        begin='<|begin_of_text|>',
        strip_content=True,  # as Meta's template does (`message['content'] | trim`)
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
    ``eos_token`` (and ``tools`` when given). ``stop_words`` hold the eos token
    text and any ``extra_stop_words``.
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
        self._extra_stop_words = list(extra_stop_words)
        self.stop_words = list(dict.fromkeys([w for w in [eos_token, *extra_stop_words] if w]))

    def render(self, messages: str | Sequence[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **kwargs) -> str:
        import jinja2
        messages = to_messages(messages)
        if self.default_system is not None and messages[0]['role'] != 'system':
            messages = [{'role': 'system', 'content': self.default_system}] + messages
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
