"""Embeddings (``pipeline.embed``, ``/v1/embeddings``, ``--task embed``) on both engines against HF
transformers' pooled last hidden states in float32 and against sentence-transformers itself, on tiny
random models saved as embedders ship: a Qwen3 backbone without its head (Qwen3-Embedding's layout)
with last-token pooling, normalized, declared Matryoshka; a Llama with its head and mean pooling,
not normalized. Then the real api_server with the real ``openai`` client, and the 400s."""
from __future__ import annotations

import base64
import json
import os
import random
import shutil

import httpx
import openai
import pytest
import torch
import transformers

from lmd import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig, pipeline
from lmd.embeddings import PoolerConfig, pool, pooler_config_from_dir
from lmd.errors import ModelFormatError
from server_utils import ServerProcess, api_server
from tiny_models import tiny_hf_model

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json')
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6)
CONFIGS = {'turbomind': TurbomindEngineConfig, 'pytorch': PytorchEngineConfig}
SESSION_LEN = 64
TEXTS = ['The quick brown fox jumps over the lazy dog.', 'Embeddings map text to vectors.', 'ünïcode — 你好']
LEGACY_POOLING = {f'pooling_mode_{m}': False for m in ('cls_token', 'mean_tokens', 'max_tokens', 'mean_sqrt_len_tokens',
                                                       'weightedmean_tokens', 'lasttoken')}


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(obj, f)


def _save_qwen3_embedder(model, path: str) -> None:
    """As Qwen3-Embedding ships: the backbone's weights alone (no ``model.`` prefix, no head),
    sentence-transformers 3.x files (Transformer, last-token Pooling, Normalize), Matryoshka declared;
    config.json names the backbone's class, as sentence-transformers saves it."""
    from safetensors.torch import save_file
    model.save_pretrained(path, safe_serialization=True)
    os.remove(os.path.join(path, 'model.safetensors'))
    save_file({k: v.contiguous() for k, v in model.model.state_dict().items()},
              os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    with open(os.path.join(path, 'config.json')) as f:
        config = json.load(f)
    _write_json(os.path.join(path, 'config.json'), dict(config, is_matryoshka=True, architectures=['Qwen3Model']))
    _write_json(os.path.join(path, 'modules.json'), [
        {'idx': 0, 'name': '0', 'path': '', 'type': 'sentence_transformers.models.Transformer'},
        {'idx': 1, 'name': '1', 'path': '1_Pooling', 'type': 'sentence_transformers.models.Pooling'},
        {'idx': 2, 'name': '2', 'path': '2_Normalize', 'type': 'sentence_transformers.models.Normalize'}])
    _write_json(os.path.join(path, '1_Pooling', 'config.json'),
                dict(LEGACY_POOLING, word_embedding_dimension=64, pooling_mode_lasttoken=True, include_prompt=True))
    os.makedirs(os.path.join(path, '2_Normalize'), exist_ok=True)


def _save_llama_embedder(model, path: str) -> None:
    """A whole causal LM with sentence-transformers 6 files: mean pooling (``pooling_mode``), no Normalize."""
    model.save_pretrained(path, safe_serialization=True)
    _write_json(os.path.join(path, 'modules.json'), [
        {'idx': 0, 'name': '0', 'path': '', 'type': 'sentence_transformers.base.modules.transformer.Transformer'},
        {'idx': 1, 'name': '1', 'path': '1_Pooling',
         'type': 'sentence_transformers.sentence_transformer.modules.pooling.Pooling'}])
    _write_json(os.path.join(path, '1_Pooling', 'config.json'),
                {'embedding_dimension': 64, 'pooling_mode': 'mean', 'include_prompt': True})


@pytest.fixture(scope='module')
def embedders(smollm2_dir, tmp_path_factory):
    """name -> (HF model, its directory with SmolLM2's tokenizer, pooling, normalize)."""
    vocab = transformers.AutoTokenizer.from_pretrained(smollm2_dir).vocab_size
    qwen3, _ = tiny_hf_model('Qwen3Config', 'Qwen3ForCausalLM', seed=11, vocab_size=vocab, head_dim=16,
                             tie_word_embeddings=True, **TINY)
    llama, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', seed=12, vocab_size=vocab, tie_word_embeddings=False,
                             bos_token_id=1, eos_token_id=2, **TINY)
    out = {}
    for name, model, save, pooling, normalize in (('qwen3', qwen3, _save_qwen3_embedder, 'last', True),
                                                  ('llama', llama, _save_llama_embedder, 'mean', False)):
        path = str(tmp_path_factory.mktemp(f'embed_{name}'))
        save(model, path)
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(smollm2_dir, f)):
                shutil.copy(os.path.join(smollm2_dir, f), path)
        out[name] = (model, path, pooling, normalize)
    return out


@pytest.fixture(scope='module', params=[(b, m) for b in CONFIGS for m in ('qwen3', 'llama')],
                ids=lambda p: f'{p[0]}-{p[1]}')
def embedder(request, embedders):
    """(backend, HF model, directory, pooling, normalize, pipeline): blocks of 16, sequences end mid-block."""
    backend, name = request.param
    model, path, pooling, normalize = embedders[name]
    config = CONFIGS[backend](session_len=SESSION_LEN, cache_block_seq_len=16, num_cache_blocks=16, dtype='float32')
    pipe = pipeline(path, backend_config=config, backend=backend)
    yield backend, model, path, pooling, normalize, pipe
    pipe.close()


_HIDDEN: dict = {}


@torch.no_grad()
def hf_embedding(model, ids: list[int], pooling: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """The reference: HF's last hidden state (after the final norm) pooled, cut, normalized, in float32."""
    key = (id(model), tuple(ids))  # each model's states once, for both engines
    if key not in _HIDDEN:
        _HIDDEN[key] = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    hidden = _HIDDEN[key]
    vec = {'last': hidden[-1], 'mean': hidden.mean(0), 'cls': hidden[0]}[pooling][:dimensions]
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


def test_embeddings_equal_hf_pooled_hidden_states(embedder):
    backend, model, _, pooling, normalize, pipe = embedder
    rng = random.Random(1)
    seqs = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (1, 23, SESSION_LEN)]
    got = pipe.embed(seqs)
    assert len(got) == len(seqs)
    for ids, vec in zip(seqs, got):
        want = hf_embedding(model, ids, pooling, normalize)
        assert isinstance(vec, list) and len(vec) == 64
        assert (torch.tensor(vec) - want).abs().max().item() < 1e-4, (backend, pooling, len(ids))
    # texts are tokenized as they are, with the tokenizer's special tokens (as sentence-transformers)
    tok = transformers.AutoTokenizer.from_pretrained(embedder[2])
    for text, vec in zip(TEXTS, pipe.embed(TEXTS)):
        want = hf_embedding(model, tok.encode(text), pooling, normalize)
        assert (torch.tensor(vec) - want).abs().max().item() < 1e-4
    assert pipe.embed(TEXTS[0]) == pipe.embed([TEXTS[0]])  # one text: a list of one


_ST: dict = {}


def test_embeddings_equal_sentence_transformers(embedder):
    st = pytest.importorskip('sentence_transformers', reason='sentence-transformers is not installed')
    backend, _, path, _, _, pipe = embedder
    if path not in _ST:
        _ST[path] = st.SentenceTransformer(path, device='cpu').encode(TEXTS, convert_to_tensor=True)
    want = _ST[path]
    got = torch.tensor(pipe.embed(TEXTS))
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4, backend


def test_matryoshka_dimensions_only_where_declared(embedder):
    backend, model, _, pooling, normalize, pipe = embedder
    ids = list(range(100, 130))
    if model.config.model_type == 'qwen3':  # declared: the first 16 values, normalized again
        (vec,) = pipe.embed([ids], dimensions=16)
        assert len(vec) == 16
        assert (torch.tensor(vec) - hf_embedding(model, ids, pooling, normalize, 16)).abs().max().item() < 1e-4
        with pytest.raises(ValueError, match='dimensions=65 is more than the 64 values'):
            pipe.embed([ids], dimensions=65)
    else:
        with pytest.raises(ValueError, match='does not declare Matryoshka'):
            pipe.embed([ids], dimensions=16)


def test_embedding_beside_a_generation_leaves_both_alone(embedder):
    """embed between the tokens of a running generation: the generation's tokens equal those of the
    same generation alone, the embeddings those of an idle engine, and no KV block leaks."""
    backend, model, _, _, _, pipe = embedder
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, do_sample=False)
    prompt = 'Retrieval needs vectors.'
    alone = pipe(prompt, gen, do_preprocess=False).token_ids
    idle = pipe.embed(TEXTS)
    tokens, beside = [], []
    for r in pipe.stream_infer(prompt, gen, do_preprocess=False):
        tokens.extend(r.token_ids)
        if len(beside) < 2:
            beside.append(pipe.embed(TEXTS))
    assert tokens == alone, backend
    assert all(b == idle for b in beside), backend
    stats = pipe.async_engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


def test_bad_inputs_are_clear_errors(embedder):
    _, model, _, _, _, pipe = embedder
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf'input\[1\] has {SESSION_LEN + 1} tokens, more than this model\'s '
                                         rf'context of {SESSION_LEN} tokens'):
        pipe.embed([[1, 2], [1] * (SESSION_LEN + 1)])
    with pytest.raises(ValueError, match=r'input\[0\] is empty'):
        pipe.embed([[]])
    with pytest.raises(ValueError, match=rf'input\[1\]: token id {vocab} is outside the vocabulary'):
        pipe.embed([[1], [vocab]])
    with pytest.raises(ValueError, match=r'input\[0\] must be a text or a list of token ids'):
        pipe.embed([3.5])
    assert pipe.embed([[5, 6]]) and pipe.async_engine.is_alive()  # still serving


# ---- the pooler, alone ---------------------------------------------------------------------------------

def test_pool_methods():
    hidden = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])
    assert pool(hidden, 'cls', normalize=False).tolist() == [3.0, 4.0]
    assert pool(hidden, 'cls').tolist() == pytest.approx([0.6, 0.8])
    assert pool(hidden, 'last').tolist() == [0.0, 1.0]
    assert pool(hidden, 'mean', normalize=False).tolist() == pytest.approx([4 / 3, 2.0])
    with pytest.raises(ValueError, match="pooling 'max' is unknown"):
        pool(hidden, 'max')


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    assert pooler_config_from_dir(str(tmp_path)) == PoolerConfig('last', True)  # no files: Qwen3-Embedding's way
    _write_json(str(tmp_path / '1_Pooling' / 'config.json'), dict(LEGACY_POOLING, pooling_mode_cls_token=True))
    assert pooler_config_from_dir(str(tmp_path)) == PoolerConfig('cls', True)  # no modules.json: normalized
    _write_json(str(tmp_path / 'config.json'), {'matryoshka_dimensions': [32, 64]})
    config = pooler_config_from_dir(str(tmp_path))
    assert config.is_matryoshka and config.matryoshka_dimensions == (32, 64)
    config.check_dimensions(32, 64)
    with pytest.raises(ValueError, match='dimensions=16 is not one this model was trained for: 32, 64'):
        config.check_dimensions(16, 64)
    for pooling, why in (({'pooling_mode': 'max'}, 'pooling max is not one lmd runs'),
                         (dict(LEGACY_POOLING, pooling_mode_mean_tokens=True, pooling_mode_cls_token=True),
                          'pooling mean \\+ cls is not one lmd runs')):
        _write_json(str(tmp_path / '1_Pooling' / 'config.json'), pooling)
        with pytest.raises(ModelFormatError, match=why):
            pooler_config_from_dir(str(tmp_path))
    _write_json(str(tmp_path / 'modules.json'), [{'path': '', 'type': 'sentence_transformers.models.Transformer'},
                                                 {'path': '2_Dense', 'type': 'sentence_transformers.models.Dense'}])
    with pytest.raises(ModelFormatError, match='modules.json lists Dense'):
        pooler_config_from_dir(str(tmp_path))


# ---- the api_server ------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def servers(embedders):
    """(the Qwen3 embedder with --task embed on TurboMind, the Llama with --task generate on PyTorch),
    started together."""
    common = ('--session-len', str(SESSION_LEN), '--log-level', 'WARNING')
    with api_server(embedders['qwen3'][1], '--task', 'embed', '--backend', 'turbomind', '--model-name',
                    'tiny-embed', *common) as embed, \
            api_server(embedders['llama'][1], '--backend', 'pytorch', '--model-name', 'tiny-gen', *common) as gen, \
            ServerProcess('proxy', ['--log-level', 'WARNING'], health_path='/v1/models') as proxy:
        yield embed.wait_ready(), gen.wait_ready(), proxy.wait_ready()


@pytest.fixture(scope='module')
def embed_server(servers):
    return servers[0]


@pytest.fixture(scope='module')
def client(embed_server):
    return openai.OpenAI(base_url=embed_server.url + '/v1', api_key='none', max_retries=0)


def test_openai_client_float_and_base64(embed_server, client, embedders):
    model, path, pooling, normalize = embedders['qwen3']
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(t) for t in TEXTS]
    want = [hf_embedding(model, i, pooling, normalize) for i in ids]
    # float, and the client's default: it asks for base64 and decodes it to floats itself
    for fmt in ('float', openai.NOT_GIVEN):
        r = client.embeddings.create(model='tiny-embed', input=TEXTS, encoding_format=fmt)
        assert r.object == 'list' and r.model == 'tiny-embed' and len(r.data) == len(TEXTS)
        assert [d.index for d in r.data] == [0, 1, 2] and all(d.object == 'embedding' for d in r.data)
        for d, w in zip(r.data, want):
            assert (torch.tensor(d.embedding) - w).abs().max().item() < 1e-4, fmt
        n = sum(map(len, ids))
        assert r.usage.prompt_tokens == r.usage.total_tokens == n
    # base64 asked for explicitly comes back as the string
    r = client.embeddings.create(model='tiny-embed', input=TEXTS[:1], encoding_format='base64')
    assert isinstance(r.data[0].embedding, str)
    # the raw base64: little-endian float32, exactly the float answer's numbers
    body = {'input': TEXTS[0], 'encoding_format': 'base64'}
    raw = httpx.post(embed_server.url + '/v1/embeddings', json=body, timeout=30).json()['data'][0]['embedding']
    floats = httpx.post(embed_server.url + '/v1/embeddings', json={'input': TEXTS[0]}, timeout=30).json()
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.float32).tolist()
    assert decoded == floats['data'][0]['embedding']
    # token ids in, and a list of them; dimensions (the model declares Matryoshka)
    r = client.embeddings.create(model='tiny-embed', input=ids[1], encoding_format='float')
    assert len(r.data) == 1 and (torch.tensor(r.data[0].embedding) - want[1]).abs().max().item() < 1e-4
    r = client.embeddings.create(model='tiny-embed', input=ids, dimensions=16, encoding_format='float')
    for d, i in zip(r.data, ids):
        assert (torch.tensor(d.embedding) - hf_embedding(model, i, pooling, normalize, 16)).abs().max().item() < 1e-4
    assert r.usage.prompt_tokens == sum(map(len, ids))


def _error(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, (path, body, r.text)
    return r.json()['error']


def test_bad_requests_are_400s_naming_the_field(embed_server):
    e = _error(embed_server, '/v1/embeddings', {'input': [[1, 2], [1] * (SESSION_LEN + 5)]})
    assert e['param'] == 'input' and e['code'] == 'context_length_exceeded'
    assert f'input[1] has {SESSION_LEN + 5} tokens' in e['message'] and str(SESSION_LEN) in e['message']
    assert _error(embed_server, '/v1/embeddings', {'input': 'x', 'dimensions': 65})['param'] == 'dimensions'
    assert _error(embed_server, '/v1/embeddings', {'input': 'x', 'dimensions': 0})['param'] == 'dimensions'
    e = _error(embed_server, '/v1/embeddings', {'input': 'x', 'encoding_format': 'hex'})
    assert e['param'] == 'encoding_format'
    assert _error(embed_server, '/v1/embeddings', {'input': [[]]})['param'] == 'input'
    assert _error(embed_server, '/v1/embeddings', {'input': ['text', [1, 2]]})['param'] == 'input'  # not mixed
    assert _error(embed_server, '/v1/embeddings', {'input': [[10 ** 9]]})['param'] == 'input'
    assert _error(embed_server, '/v1/embeddings', {'input': 'x', 'pooling': 'max'})['param'] == 'pooling'
    assert _error(embed_server, '/v1/embeddings', {'model': 'tiny-embed'})['param'] == 'input'
    # an embedder does not generate: the generating routes say why, and which flag
    for path, body in (('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}]}),
                       ('/v1/completions', {'prompt': 'hi'}), ('/generate', {'prompt': 'hi'})):
        e = _error(embed_server, path, body)
        assert '--task embed' in e['message'] and e['code'] == 'wrong_task', path
    assert httpx.get(embed_server.url + '/health', timeout=10).status_code == 200


def test_a_generating_server_embeds_beside_its_streams(servers, embedders):
    """--task generate serves /v1/embeddings too: a chat streams while embeddings are asked for, and
    its tokens equal those of the same chat alone; the embeddings equal HF's."""
    gen_server = servers[1]
    model, path, pooling, normalize = embedders['llama']
    client = openai.OpenAI(base_url=gen_server.url + '/v1', api_key='none', max_retries=0)
    chat = dict(model='tiny-gen', messages=[{'role': 'user', 'content': 'Tell me about vectors.'}], temperature=0,
                max_tokens=24, extra_body={'ignore_eos': True})
    alone = client.chat.completions.create(**chat).choices[0].message.content
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = [hf_embedding(model, tok.encode(t), pooling, normalize) for t in TEXTS]
    pieces, embedded = [], 0
    for chunk in client.chat.completions.create(**chat, stream=True):
        pieces.append(chunk.choices[0].delta.content or '' if chunk.choices else '')
        if embedded < 2:
            r = client.embeddings.create(model='tiny-gen', input=TEXTS)
            for d, w in zip(r.data, want):
                assert (torch.tensor(d.embedding) - w).abs().max().item() < 1e-4
            embedded += 1
    assert embedded == 2 and ''.join(pieces) == alone
    # the Llama declares no Matryoshka sizes
    e = _error(gen_server, '/v1/embeddings', {'input': 'x', 'dimensions': 8})
    assert e['param'] == 'dimensions' and 'does not declare Matryoshka' in e['message']


def test_the_proxy_relays_embeddings(servers):
    embed_server, _, proxy = servers
    r = httpx.post(proxy.url + '/nodes/add', json={'url': embed_server.url}, timeout=30)
    assert r.status_code == 200, r.text
    direct = httpx.post(embed_server.url + '/v1/embeddings', json={'input': TEXTS}, timeout=30).json()
    client = openai.OpenAI(base_url=proxy.url + '/v1', api_key='none', max_retries=0)
    relayed = client.embeddings.create(model='tiny-embed', input=TEXTS, encoding_format='float')
    assert [d.embedding for d in relayed.data] == [d['embedding'] for d in direct['data']]
