"""Chat templates: the model's own Jinja template against transformers, the built-ins against
the models' real formats, and message validation."""
import jinja2
import pytest

from lmd.chat_template import (BUILTIN_TEMPLATES, INTERNLM2_META_INSTRUCTION, ChatTemplate, JinjaChatTemplate,
                               get_chat_template, to_messages)
from lmd.messages import ChatTemplateConfig
from lmd.tokenizer import Tokenizer


@pytest.fixture(scope='session')
def smol(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope='session')
def plain_tokenizer(tmp_path_factory) -> Tokenizer:
    """A tokenizer with no chat template that adds BOS, like a base Llama model's."""
    from tokenizers import AddedToken, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast
    raw = RawTokenizer(models.WordLevel({'<unk>': 0, '<s>': 1, '</s>': 2, 'hi': 3}, unk_token='<unk>'))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens([AddedToken(t, special=True) for t in ('<unk>', '<s>', '</s>')])
    raw.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
    path = tmp_path_factory.mktemp('plain')
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token='<s>', eos_token='</s>',
                            unk_token='<unk>').save_pretrained(str(path))
    return Tokenizer(str(path))


SYSTEM = 'You are terse.'
CONVERSATION = [
    {'role': 'system', 'content': SYSTEM},
    {'role': 'user', 'content': 'Hi!'},
    {'role': 'assistant', 'content': 'Hello. '},
    {'role': 'user', 'content': 'What is 2+2?'},
    {'role': 'assistant', 'content': '4'},
    {'role': 'user', 'content': 'Thanks'},
]

CONVERSATIONS = [
    CONVERSATION,
    CONVERSATION[1:],
    [{'role': 'user', 'content': 'just one 你好 😀'}],
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'parts'}, {'type': 'text', 'text': ' joined'}]}],
]


# -- the model's own template ---------------------------------------------------------------------

@pytest.mark.parametrize('add_generation_prompt', [True, False])
@pytest.mark.parametrize('messages', CONVERSATIONS)
def test_smollm2_template_matches_transformers(smol, messages, add_generation_prompt):
    template = get_chat_template(smol, None)
    assert isinstance(template, JinjaChatTemplate) and isinstance(template, ChatTemplate)
    expected = smol.hf_tokenizer.apply_chat_template(to_messages(messages), tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    assert '<|im_end|>' in template.stop_words


def test_smollm2_default_system_prompt(smol):
    text = get_chat_template(smol, None).render('Hi')
    assert text == ('<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face'
                    '<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')


# Exercises what HF's environment offers: trim/lstrip blocks, tojson, raise_exception,
# namespace, loop controls, {% generation %} and bos/eos variables.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% if tools %}
<tools>{{ tools | tojson }}</tools>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}|{{ message['role'] }}]
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}
{{ message['content'] | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[assistant]
{% endif %}"""


@pytest.mark.parametrize('messages', CONVERSATIONS)
def test_rich_jinja_template_matches_transformers(smol, messages):
    tools = [{'type': 'function', 'function': {'name': 'add', 'description': 'adds <a> & "b"'}}]
    ours = JinjaChatTemplate(RICH_TEMPLATE, smol.bos_token, smol.eos_token)
    for kwargs in ({}, {'tools': tools}):
        expected = smol.hf_tokenizer.apply_chat_template(to_messages(messages), chat_template=RICH_TEMPLATE,
                                                         tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.render(messages, **kwargs) == expected
    assert ours.stop_words == ['<|im_end|>']


def test_jinja_raise_exception_and_syntax_errors_are_value_errors():
    template = JinjaChatTemplate(RICH_TEMPLATE, '<s>', '</s>')
    with pytest.raises(ValueError, match='bad role tool'):
        template.render([{'role': 'tool', 'content': 'x'}])
    with pytest.raises(ValueError, match='not valid Jinja'):
        JinjaChatTemplate('{% for m in messages %}', '<s>', '</s>')


def test_jinja_sandbox_blocks_attribute_escapes():
    template = JinjaChatTemplate("{{ messages.__class__.__mro__ }}", '<s>', '</s>')
    with pytest.raises(ValueError, match='unsafe') as e:
        template.render('x')
    assert isinstance(e.value.__cause__, jinja2.exceptions.SecurityError)


# -- built-ins ------------------------------------------------------------------------------------

EXPECTED = {
    'chatml': ('<|im_start|>system\nYou are terse.<|im_end|>\n'
               '<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello. <|im_end|>\n'
               '<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n'
               '<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n'),
    'llama3': ('<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>'
               '<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>'
               '<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>'
               '<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>'
               '<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>'
               '<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|>'
               '<|start_header_id|>assistant<|end_header_id|>\n\n'),
    'base': 'You are terse.Hi!Hello. What is 2+2?4Thanks',
}
EXPECTED['qwen2'] = EXPECTED['chatml']
EXPECTED['internlm2'] = '<s>' + EXPECTED['chatml']


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_builtin_renders_three_turns_with_system(name):
    assert BUILTIN_TEMPLATES[name].render(CONVERSATION) == EXPECTED[name]


def test_builtin_default_system_prompts():
    assert BUILTIN_TEMPLATES['qwen2'].render('Hi') == (
        '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
        '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
    assert BUILTIN_TEMPLATES['internlm2'].render('Hi') == (
        f'<s><|im_start|>system\n{INTERNLM2_META_INSTRUCTION}<|im_end|>\n'
        '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
    assert BUILTIN_TEMPLATES['chatml'].render('Hi') == '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n'
    assert BUILTIN_TEMPLATES['llama3'].render('Hi', add_generation_prompt=False) == (
        '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>')
    assert BUILTIN_TEMPLATES['base'].render('Once upon a time') == 'Once upon a time'


def test_builtin_stop_words():
    assert BUILTIN_TEMPLATES['chatml'].stop_words == ['<|im_end|>']
    assert '<|eot_id|>' in BUILTIN_TEMPLATES['llama3'].stop_words
    assert '<|im_end|>' in BUILTIN_TEMPLATES['qwen2'].stop_words
    assert '<|im_end|>' in BUILTIN_TEMPLATES['internlm2'].stop_words
    assert BUILTIN_TEMPLATES['base'].stop_words == []


def test_llama3_matches_its_jinja_template(smol):
    # Meta's Llama 3 template, as the model ships it.
    llama3_jinja = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
                    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
                    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
                    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
                    "{% if add_generation_prompt %}"
                    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    jinja = JinjaChatTemplate(llama3_jinja, '<|begin_of_text|>', '<|eot_id|>')
    assert jinja.render(CONVERSATION) == BUILTIN_TEMPLATES['llama3'].render(CONVERSATION)


# -- choosing a template ----------------------------------------------------------------------------

def test_config_picks_builtin_and_overrides_system(smol):
    assert get_chat_template(smol, ChatTemplateConfig('llama3')).render(CONVERSATION) == EXPECTED['llama3']
    qwen = get_chat_template(smol, ChatTemplateConfig('qwen2', meta_instruction='Be brief.'))
    assert qwen.render('Hi').startswith('<|im_start|>system\nBe brief.<|im_end|>\n')
    assert qwen.render(CONVERSATION) == EXPECTED['qwen2']  # the messages' own system prompt wins
    chatml = get_chat_template(smol, ChatTemplateConfig('chatml', system='Be kind.'))
    assert chatml.render('Hi').startswith('<|im_start|>system\nBe kind.<|im_end|>\n')
    assert BUILTIN_TEMPLATES['qwen2'].render('Hi').startswith('<|im_start|>system\nYou are a helpful')  # untouched


def test_config_custom_jinja(smol):
    custom = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    config = ChatTemplateConfig('chatml', chat_template=custom, system='S')
    template = get_chat_template(smol, config)
    assert template.render('Hi') == '<system>S<user>Hi<assistant>'
    assert '<|im_end|>' in template.stop_words


def test_model_without_template_falls_back_to_base(plain_tokenizer):
    template = get_chat_template(plain_tokenizer, None)
    assert template.name == 'base'
    # the prompt is encoded without special tokens, so base writes the BOS the tokenizer would add
    text = template.render('hi')
    assert text == '<s>hi'
    assert plain_tokenizer.encode(text, add_special_tokens=False) == plain_tokenizer.encode('hi') == [1, 3]


def test_unknown_builtin_is_rejected():
    with pytest.raises(ValueError, match="model_name='nope'.*chatml"):
        ChatTemplateConfig('nope')


# -- messages ---------------------------------------------------------------------------------------

def test_to_messages_accepts_strings_and_parts():
    assert to_messages('hi') == [{'role': 'user', 'content': 'hi'}]
    msgs = to_messages([{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}],
                         'name': 'me'},
                        {'role': 'assistant', 'content': None, 'tool_calls': [{'id': '1'}]},
                        {'role': 'tool', 'content': '42', 'tool_call_id': '1'}])
    assert msgs[0] == {'role': 'user', 'content': 'ab', 'name': 'me'}
    assert msgs[1]['content'] == '' and msgs[1]['tool_calls'] == [{'id': '1'}]
    assert msgs[2]['content'] == '42'


@pytest.mark.parametrize('prompt, match', [
    ([], 'empty'),
    (42, 'string or a list of messages'),
    (['hi'], r'messages\[0\] must be a dict'),
    ([{'role': 'user', 'content': 'a'}, {'role': 'bot', 'content': 'b'}], r"messages\[1\]\.role='bot'"),
    ([{'content': 'a'}], r'messages\[0\]\.role=None'),
    ([{'role': 'user'}], r'messages\[0\] has no "content"'),
    ([{'role': 'user', 'content': 3}], r'messages\[0\]\.content must be'),
    ([{'role': 'user', 'content': None}], r'messages\[0\]\.content must be'),
    ([{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {}}]}],
     r"messages\[0\]\.content\[0\].*'image_url'"),
    ([{'role': 'user', 'content': [{'type': 'text'}]}], r'messages\[0\]\.content\[0\]\.text must be a string'),
])
def test_bad_messages_raise_value_error(prompt, match):
    with pytest.raises(ValueError, match=match):
        to_messages(prompt)
    with pytest.raises(ValueError, match=match):
        BUILTIN_TEMPLATES['chatml'].render(prompt)


# -- tools ------------------------------------------------------------------------------------------

# A Qwen2.5-style template (written for this test): tools in the system prompt, calls and results.
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
{{- '\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

TOOLS = [{'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The weather in a city, in °C',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}]
TOOL_CONVERSATION = [
    {'role': 'system', 'content': SYSTEM},
    {'role': 'user', 'content': 'Weather in Paris and 東京?'},
    {'role': 'assistant', 'content': None, 'tool_calls': [
        {'id': 'c1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}},
        {'id': 'c2', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': '東京'}}}]},
    {'role': 'tool', 'tool_call_id': 'c1', 'content': '18'},
    {'role': 'tool', 'tool_call_id': 'c2', 'content': '22'},
]


def _hf_messages(messages):
    """What HF templates get: arguments as dicts."""
    import json
    out = []
    for m in to_messages(messages):
        if m.get('tool_calls'):
            m = {**m, 'tool_calls': [{**c, 'function': {**c['function'], 'arguments': json.loads(
                c['function']['arguments']) if isinstance(c['function']['arguments'], str)
                else c['function']['arguments']}} for c in m['tool_calls']]}
        out.append(m)
    return out


def test_jinja_template_with_tools_matches_transformers(smol):
    template = JinjaChatTemplate(QWEN_TOOLS_TEMPLATE, smol.bos_token, '<|im_end|>')
    assert template.knows_tools and template.knows_tool_calls
    for messages in (TOOL_CONVERSATION, TOOL_CONVERSATION[1:2]):
        ours = template.render(messages, tools=TOOLS)
        expected = smol.hf_tokenizer.apply_chat_template(_hf_messages(messages), chat_template=QWEN_TOOLS_TEMPLATE,
                                                         tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert ours == expected
    text = template.render(TOOL_CONVERSATION, tools=TOOLS)
    assert '"description": "The weather in a city, in °C"' in text   # tojson keeps unicode
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>' in text
    assert '<tool_response>\n22\n</tool_response>' in text
    # a bare function is wrapped as HF expects; no tools renders without the tools block
    assert template.render(TOOL_CONVERSATION[1:2], tools=[TOOLS[0]['function']]) == template.render(
        TOOL_CONVERSATION[1:2], tools=TOOLS)
    assert '# Tools' not in template.render(TOOL_CONVERSATION[1:2], tools=[])


def test_jinja_template_without_tools_gets_them_in_the_system_prompt(smol):
    template = get_chat_template(smol, None)   # SmolLM2's template knows nothing of tools
    assert not template.knows_tools
    text = template.render(TOOL_CONVERSATION, tools=TOOLS)
    assert text.startswith('<|im_start|>system\nYou are terse.\n\n# Tools\n')
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n') in text
    assert '<|im_start|>user\n<tool_response>\n18\n</tool_response>\n<tool_response>\n22\n</tool_response>' in text
    # without tools the template renders as before
    assert template.render(CONVERSATION, tools=None) == template.render(CONVERSATION)


def test_builtin_hermes_tools():
    text = BUILTIN_TEMPLATES['qwen2'].render(TOOL_CONVERSATION[1:], tools=TOOLS)
    assert text.startswith('<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one')
    assert text.endswith('<|im_start|>user\n<tool_response>\n18\n</tool_response>\n<tool_response>\n22\n'
                         '</tool_response><|im_end|>\n<|im_start|>assistant\n')
    chatml = BUILTIN_TEMPLATES['chatml'].render('Hi', tools=TOOLS)
    assert chatml.startswith('<|im_start|>system\n# Tools\n') and '</tools>' in chatml
    # tools change nothing else: without them the built-ins render as before
    assert BUILTIN_TEMPLATES['chatml'].render(CONVERSATION, tools=None) == EXPECTED['chatml']


def test_builtin_llama3_and_internlm2_tools():
    llama = BUILTIN_TEMPLATES['llama3'].render(TOOL_CONVERSATION, tools=TOOLS)
    assert 'You are terse.\n\nGiven the following functions' in llama
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": '
            '"Paris"}}; {"name": "get_weather", "parameters": {"city": "東京"}}<|eot_id|>') in llama
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n18<|eot_id|>' in llama
    intern = BUILTIN_TEMPLATES['internlm2'].render(TOOL_CONVERSATION, tools=TOOLS)
    assert intern.startswith('<s><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>system name=<|plugin|>\n[')
    assert ('<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>'
            in intern)
    assert '<|im_start|>environment name=<|plugin|>\n22<|im_end|>\n<|im_start|>assistant\n' in intern


@pytest.mark.parametrize('tools, match', [
    ('get_weather', r'tools must be a list'),
    ([3], r'tools\[0\] must be a dict'),
    ([{'type': 'retrieval'}], r"tools\[0\]\.type='retrieval' is invalid"),
    ([{'type': 'function', 'function': {'description': 'x'}}], r'tools\[0\]\.function\.name must be'),
])
def test_bad_tools_raise_value_error(smol, tools, match):
    for template in (BUILTIN_TEMPLATES['qwen2'], get_chat_template(smol, None),
                     JinjaChatTemplate(QWEN_TOOLS_TEMPLATE, '', '<|im_end|>')):
        with pytest.raises(ValueError, match=match):
            template.render('Hi', tools=tools)


@pytest.mark.parametrize('template', ['qwen2', 'llama3', 'jinja'])
def test_bad_tool_calls_raise_value_error(template):
    t = JinjaChatTemplate(QWEN_TOOLS_TEMPLATE, '', '') if template == 'jinja' else BUILTIN_TEMPLATES[template]
    bad = [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': None, 'tool_calls': [{'id': '1'}]}]
    with pytest.raises(ValueError, match=r'messages\[1\]\.tool_calls\[0\]\.function\.name must be a string'):
        t.render(bad)
    bad[1]['tool_calls'] = [{'function': {'name': 'f', 'arguments': 3}}]
    with pytest.raises(ValueError, match=r'messages\[1\]\.tool_calls\[0\]\.function\.arguments must be'):
        t.render(bad)
