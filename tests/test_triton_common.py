"""lmd.triton_models.common: the Triton models' input handling, prompts and stateless detokenization
(no server needed; test_triton.py runs the same code inside a real tritonserver)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from lmd.triton_models import common
from lmd.triton_models.common import InputError


@pytest.fixture(scope='module')
def text_side(smollm2_dir):
    from lmd.chat_template import get_chat_template
    from lmd.tokenizer import Tokenizer
    tok = Tokenizer(smollm2_dir)
    return tok, get_chat_template(tok)


def _get(**arrays):
    return lambda name: arrays.get(name)


def test_read_inputs_turns_tensors_into_values():
    spec = {'prompt': 'text', 'max_tokens': 'int', 'top_p': 'float', 'ignore_eos': 'bool', 'stop_words': 'texts',
            'input_ids': 'ids', 'session_id': 'uint'}
    values = common.read_inputs(_get(prompt=np.array([b'hi \xc3\xa9'], dtype=np.object_),
                                     max_tokens=np.array([7], np.int32), top_p=np.array([0.5], np.float32),
                                     ignore_eos=np.array([True]), stop_words=np.array([b'a', b'b'], np.object_),
                                     input_ids=np.array([1, 2, 3], np.int32),
                                     session_id=np.array([9], np.uint64)), spec)
    assert values == {'prompt': 'hi \u00e9', 'max_tokens': 7, 'top_p': 0.5, 'ignore_eos': True,
                      'stop_words': ['a', 'b'], 'input_ids': [1, 2, 3], 'session_id': 9}
    assert common.read_inputs(_get(), spec) == {}  # absent inputs are left out


@pytest.mark.parametrize('arrays, message', [
    ({'max_tokens': np.array([1, 2], np.int32)}, "input 'max_tokens' must hold one value, got shape [2]"),
    ({'max_tokens': np.array([1.0], np.float32)}, "input 'max_tokens' has datatype float32"),
    ({'prompt': np.array([b'\xff'], np.object_)}, "input 'prompt' is not valid UTF-8"),
])
def test_read_inputs_names_the_bad_input(arrays, message):
    with pytest.raises(InputError, match=re.escape(message)):
        common.read_inputs(_get(**arrays), {'prompt': 'text', 'max_tokens': 'int'})


def test_generation_config_is_greedy_unless_asked_to_sample():
    g = common.generation_config({'max_tokens': 9})
    assert g.max_new_tokens == 9 and not g.do_sample
    g = common.generation_config({'temperature': 0.7, 'top_k': 20, 'random_seed': 5, 'stop_words': ['x', '']})
    assert g.do_sample and g.temperature == 0.7 and g.top_k == 20 and g.random_seed == 5 and g.stop_words == ['x']
    assert not common.generation_config({'temperature': 0.7, 'top_k': 1}).do_sample
    assert not common.generation_config({'temperature': 0.0}).do_sample


@pytest.mark.parametrize('values, name', [({'max_tokens': -1}, "'max_tokens'"), ({'top_p': 1.5}, 'top_p'),
                                          ({'temperature': -1.0}, 'temperature')])
def test_generation_config_errors_name_the_input(values, name):
    with pytest.raises(InputError, match=name):
        common.generation_config(values)


def test_session_inputs():
    assert common.session_of({}) == (None, True, True)
    assert common.session_of({'session_id': 3, 'sequence_end': False}) == (3, True, False)
    with pytest.raises(InputError, match="'session_id' is required"):
        common.session_of({'sequence_end': False})
    with pytest.raises(InputError, match="'session_id' is 0"):
        common.session_of({'session_id': 0})


def test_parse_prompt():
    msgs = [{'role': 'user', 'content': 'hi'}]
    assert common.parse_prompt('[{"role": "user", "content": "hi"}]') == msgs
    assert common.parse_prompt('[1, 2] sorted?') == '[1, 2] sorted?'
    assert common.parse_prompt('[1, 2]') == '[1, 2]'
    assert common.parse_prompt('hello') == 'hello'


def test_continuation_is_what_a_kept_session_needs(text_side):
    """The next turn's ids are exactly what AsyncEngine.chat prefills: the full conversation's ids past
    what the engine holds (the first prompt and the answer; the engine model drops the leading stop
    token when the answer ended with it)."""
    tok, template = text_side
    first = [{'role': 'user', 'content': 'My name is Ada.'}]
    answer = 'Nice to meet you, Ada!'
    held = common.prompt_ids(tok, template, first[0]['content']) + tok.encode(answer, add_special_tokens=False)
    full = tok.encode(template.render(first + [{'role': 'assistant', 'content': answer},
                                               {'role': 'user', 'content': 'What is my name?'}]),
                      add_special_tokens=False)
    assert full[:len(held)] == held
    cont = common.prompt_ids(tok, template, 'What is my name?', sequence_start=False)
    assert cont == full[len(held):]
    assert tok.decode(cont[:1], skip_special_tokens=False) == template.stop_words[0]


def test_text_increments_hold_back_partial_characters_and_stop_words(text_side):
    tok, _ = text_side
    text = 'ok \u4e16\u754c \U0001F642 STOP and more'
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [common.text_increment(tok, ids[:k], k - 1, final=k == len(ids)) for k in range(1, len(ids) + 1)]
    assert ''.join(pieces) == text and not any('\ufffd' in p for p in pieces)
    pieces = [common.text_increment(tok, ids[:k], k - 1, final=k == len(ids), stop_words=['STOP'])
              for k in range(1, len(ids) + 1)]
    assert ''.join(pieces) == 'ok \u4e16\u754c \U0001F642 '
    assert not any('S' in p for p in pieces)  # 'S', 'ST'... were held back, then cut
    with pytest.raises(InputError, match="'prev_length'"):
        common.text_increment(tok, ids[:2], 5, final=False)
