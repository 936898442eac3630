"""vLLM's tokenizer routes on a real api_server: ``/tokenize`` (a prompt, or chat messages through the
chat template) and ``/detokenize`` against HF's tokenizer of the same model, ``/tokenizer_info`` read
by lm-evaluation-harness' own remote tokenizer, and bad input answered with a 400 naming the field."""
from __future__ import annotations

import httpx
import pytest
import transformers

from server_utils import api_server, tiny_model_dir

KEY = 'sk-tok'
SESSION_LEN = 256
CHAT = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Héllo, wörld! 你好'}]


@pytest.fixture(scope='module')
def model_dir(smollm2_dir, tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp('tiny_tok')), smollm2_dir)


@pytest.fixture(scope='module')
def server(model_dir):
    with api_server(model_dir, '--backend', 'pytorch', '--session-len', str(SESSION_LEN), '--model-name', 'tiny',
                    '--api-keys', KEY, '--log-level', 'WARNING') as s:
        yield s.wait_ready()


@pytest.fixture(scope='module')
def http(server):
    with httpx.Client(base_url=server.url, headers={'Authorization': f'Bearer {KEY}'}, timeout=30) as c:
        yield c


@pytest.fixture(scope='module')
def hf(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_tokenize_a_prompt_as_hf(http, hf):
    text = 'The quick brown fox, 你好 — ünïcode.'
    for special in (True, False):
        r = http.post('/tokenize', json={'prompt': text, 'add_special_tokens': special}).json()
        want = hf.encode(text, add_special_tokens=special)
        assert r == {'count': len(want), 'max_model_len': SESSION_LEN, 'tokens': want}
    r = http.post('/tokenize', json={'prompt': text, 'return_token_strs': True, 'model': 'tiny'}).json()
    assert r['token_strs'] == hf.convert_ids_to_tokens(r['tokens'])


@pytest.mark.parametrize('add_generation_prompt', [True, False])
def test_tokenize_messages_through_the_chat_template(http, hf, add_generation_prompt):
    r = http.post('/tokenize', json={'messages': CHAT, 'add_generation_prompt': add_generation_prompt}).json()
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert r['tokens'] == hf.encode(text, add_special_tokens=False)
    assert r['count'] == len(r['tokens'])
    # back to the rendered text, special tokens kept
    assert http.post('/detokenize', json={'tokens': r['tokens']}).json() == {'prompt': text}


def test_tokenizer_info_serves_lm_eval_remote_tokenizer(server, http, hf):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    info = http.get('/tokenizer_info').json()
    assert info['eos_token'] == hf.eos_token and info['bos_token'] == hf.bos_token
    assert info['chat_template'] == hf.chat_template
    assert info['model_max_length'] == SESSION_LEN and info['vocab_size'] == len(hf)
    url = server.url + '/v1/completions'
    assert check_remote_tokenizer_support(url, auth_token=KEY)
    remote = RemoteTokenizer(url, auth_token=KEY)
    text = ' Paris is the capital of France.'
    assert remote.encode(text) == hf.encode(text, add_special_tokens=False)
    assert remote.decode(hf.encode(text)) == text
    assert remote.eos_token_id == hf.eos_token_id
    assert remote.apply_chat_template(CHAT) == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize('path, body, param', [
    ('/tokenize', {}, 'prompt'),
    ('/tokenize', {'prompt': 'a', 'messages': CHAT}, 'messages'),
    ('/tokenize', {'prompt': 'a', 'tools': [{'type': 'function', 'function': {'name': 'f'}}]}, 'tools'),
    ('/tokenize', {'messages': [{'content': 'no role'}]}, 'messages'),
    ('/tokenize', {'prompt': 7}, 'prompt'),
    ('/tokenize', {'prompt': 'a', 'model': 'other'}, 'model'),
    ('/detokenize', {'tokens': [1, 10**6]}, 'tokens'),
    ('/detokenize', {'tokens': [-1]}, 'tokens'),
    ('/detokenize', {}, 'tokens'),
])
def test_bad_input_names_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == (404 if param == 'model' else 400), r.text
    assert r.json()['error']['param'] == param, r.text


def test_the_key_is_checked(server):
    for method, path, body in (('POST', '/tokenize', {'prompt': 'a'}), ('POST', '/detokenize', {'tokens': [1]}),
                               ('GET', '/tokenizer_info', None)):
        r = httpx.request(method, server.url + path, json=body)
        assert r.status_code == 401, (path, r.text)
