"""Multi-LoRA on a real api_server, talked to by the openai client: ``--adapters`` at start, the
``model`` field choosing the adapter (answers equal to HF + PEFT's greedy tokens), ``/v1/models``
listing adapters under their base, and vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
at run time, with their errors. Both engines."""
from __future__ import annotations

import httpx
import openai
import pytest
import transformers

from lora_utils import make_adapter, peft_greedy
from server_utils import api_server, tiny_model_dir

PROMPT = 'Write one line about the sea.'


@pytest.fixture(scope='module')
def tiny(smollm2_dir, tmp_path_factory):
    """(base folder, HF model, {name: adapter folder}, tokenizer)"""
    out = tmp_path_factory.mktemp('lora_server')
    base = tiny_model_dir(str(out / 'base'), smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype='float32').eval()
    adapters = {'sql': make_adapter(model, str(out / 'sql'), seed=1, r=8, lora_alpha=32,
                                    target_modules=['q_proj', 'v_proj', 'down_proj']),
                'chat': make_adapter(model, str(out / 'chat'), seed=2, r=4, lora_alpha=8, use_rslora=True,
                                     target_modules=['k_proj', 'o_proj', 'gate_proj', 'up_proj'])}
    return base, model, adapters, transformers.AutoTokenizer.from_pretrained(base)


@pytest.fixture(scope='module', params=['pytorch', 'turbomind'])
def server(request, tiny):
    base, _, adapters, _ = tiny
    with api_server(base, '--backend', request.param, '--model-name', 'tiny', '--session-len', '256',
                    '--adapters', f'sql={adapters["sql"]}', '--log-level', 'WARNING') as s:
        yield s.wait_ready()


def greedy_text(client, model: str, n: int = 8) -> tuple[str, list[int]]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body={'ignore_eos': True})
    return r.choices[0].text, r.model


def test_adapters_answer_as_peft(server, tiny):
    base, model, adapters, tok = tiny
    client = openai.OpenAI(base_url=server.url + '/v1', api_key='none')
    ids = tok.encode(PROMPT)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {'tiny', 'sql'}
    assert models['sql'].parent == 'tiny' and models['sql'].root == adapters['sql']
    texts = {}
    for name, folder in [('tiny', None), ('sql', adapters['sql'])]:
        texts[name], reported = greedy_text(client, name)
        assert reported == name
        assert texts[name] == tok.decode(peft_greedy(model, folder, ids, 8)), name
    assert texts['tiny'] != texts['sql']
    # a chat answer under the adapter, streamed, names it too
    chunks = list(client.chat.completions.create(model='sql', messages=[{'role': 'user', 'content': 'hi'}],
                                                 max_tokens=4, stream=True))
    assert {c.model for c in chunks} == {'sql'}
    with pytest.raises(openai.NotFoundError, match="'nope'"):
        client.completions.create(model='nope', prompt=PROMPT, max_tokens=2)


def test_load_and_unload_at_run_time(server, tiny, tmp_path):
    base, model, adapters, tok = tiny
    client = openai.OpenAI(base_url=server.url + '/v1', api_key='none')
    http = httpx.Client(base_url=server.url, timeout=60)
    r = http.post('/v1/load_lora_adapter', json={'lora_name': 'chat', 'lora_path': adapters['chat']})
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {'tiny', 'sql', 'chat'}
    text, _ = greedy_text(client, 'chat')
    assert text == tok.decode(peft_greedy(model, adapters['chat'], tok.encode(PROMPT), 8))
    # errors name what was wrong, and the server keeps serving
    r = http.post('/v1/load_lora_adapter', json={'lora_name': 'chat', 'lora_path': adapters['chat']})
    assert r.status_code == 400 and r.json()['error']['param'] == 'lora_name'
    r = http.post('/v1/load_lora_adapter', json={'lora_name': 'x', 'lora_path': str(tmp_path)})
    assert r.status_code == 400 and 'adapter_config.json' in r.json()['error']['message']
    r = http.post('/v1/unload_lora_adapter', json={'lora_name': 'nope'})
    assert r.status_code == 404
    r = http.post('/v1/unload_lora_adapter', json={'lora_name': 'chat'})
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {'tiny', 'sql'}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model='chat', prompt=PROMPT, max_tokens=2)
    assert greedy_text(client, 'sql')[1] == 'sql'
