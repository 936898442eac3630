"""Tokenizer wrapper, incremental detokenizer and stop strings.

Three tokenizers: the real SmolLM2 one (byte-level BPE), a Llama-2-style
SentencePiece BPE with byte fallback (``<0xE4>`` tokens, leading-space strip),
and a Metaspace one; the last two are trained here on a few sentences.
"""
import json

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as RawTokenizer

from lmd.tokenizer import DetokenizeState, StopStringMatcher, Tokenizer

CORPUS = [
    'The quick brown fox jumps over the lazy dog.',
    'Hello world! Hello there, how are you doing today?',
    'Tokenizers split text into pieces; the model reads ids.',
    'A stop string may span two tokens, like the end of this line.',
    'Numbers 0123456789 and punctuation: (a), [b], {c}, "d", \'e\'.',
] * 20

TEXTS = [
    'Hello world',
    ' leading space and trailing space ',
    'multiple   spaces    between  words',
    'new\nlines\n\n\nand\ttabs\r\n',
    'emoji 😀🎉👍🏽 and a family 👨‍👩‍👧',
    '中文字符和日本語のテキスト、한국어',
    'accented café naïve résumé, and decomposed e\u0301 a\u0300',
    'mixed: 1+1=2 → ∑ ≠ ∞ «quotes» — dash…',
    '   ',
    'x',
]


@pytest.fixture(scope='session')
def smol(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def _train_bpe(pre_tokenizer, vocab_size=200):
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizer
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    model = json.loads(raw.to_str())['model']
    merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m) for m in model['merges']]
    return model['vocab'], merges


def _save(raw, path, **special) -> str:
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=raw, **special).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope='session')
def byte_fallback(tmp_path_factory) -> Tokenizer:
    """Llama-2 style: '▁' for spaces, <0xNN> tokens for anything outside the vocab, BOS added."""
    vocab, merges = _train_bpe(pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first'))
    # Training kept only ASCII (and '▁'); newlines, CJK, emoji, accents decode through byte tokens.
    vocab = {tok: i for i, tok in enumerate(['<unk>', '<s>', '</s>'] + [f'<0x{b:02X}>' for b in range(256)]
                                          + sorted(vocab, key=vocab.get))}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token='<unk>', byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
    raw.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(' ', 1, 0)])
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ('<unk>', '<s>', '</s>')])
    raw.add_tokens([AddedToken('<tool>', special=False, normalized=False)])
    raw.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
    return Tokenizer(_save(raw, tmp_path_factory.mktemp('byte_fallback'), bos_token='<s>', eos_token='</s>',
                           unk_token='<unk>'))


@pytest.fixture(scope='session')
def metaspace(tmp_path_factory) -> Tokenizer:
    """Metaspace pre-tokenizer and decoder (prepend always): the decoder drops the first token's space."""
    pre = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='always')
    raw = RawTokenizer(models.BPE(unk_token='<unk>'))
    raw.pre_tokenizer = pre
    raw.decoder = decoders.Metaspace(replacement='▁', prepend_scheme='always')
    alphabet = sorted(set(''.join(TEXTS + CORPUS)) - {' '})
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=alphabet,
                                                        special_tokens=['<unk>', '<s>', '</s>']))
    return Tokenizer(_save(raw, tmp_path_factory.mktemp('metaspace'), bos_token='<s>', eos_token='</s>',
                           unk_token='<unk>'))


@pytest.fixture(params=['smol', 'byte_fallback', 'metaspace'])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(tok: Tokenizer, ids, state=None, skip_special_tokens=True, step=1):
    """Feed ids ``step`` at a time; return the increments (the last one from the final flush)."""
    state = state or DetokenizeState()
    pieces = []
    for end in range(step, len(ids) + step, step):
        text, state = tok.detokenize_incrementally(ids[:end], state, skip_special_tokens=skip_special_tokens)
        pieces.append(text)
    text, state = tok.detokenize_incrementally(ids, state, skip_special_tokens=skip_special_tokens, final=True)
    pieces.append(text)
    return pieces


# -- the wrapper ----------------------------------------------------------------------------------

def test_smollm2_properties(smol):
    assert smol.vocab_size == 49152
    assert smol.eos_token == '<|im_end|>' and smol.eos_token_ids[0] == 2
    assert len(set(smol.eos_token_ids)) == len(smol.eos_token_ids)
    assert {0, 1, 2} <= set(smol.all_special_ids)
    assert '<|im_start|>' in smol.chat_template
    assert not smol.add_bos_token
    ids = smol.encode('Hello world')
    assert ids == smol.encode('Hello world', add_special_tokens=False)  # no BOS configured
    assert smol.decode(ids) == 'Hello world'
    assert smol.decode(smol.encode('<|im_start|>user\nhi<|im_end|>')) == 'user\nhi'
    assert smol.decode(smol.encode('<|im_start|>hi'), skip_special_tokens=False) == '<|im_start|>hi'


def test_bos_added_only_when_configured_and_never_twice(byte_fallback):
    ids = byte_fallback.encode('Hello world')
    assert ids[0] == byte_fallback.bos_token_id == 1 and byte_fallback.add_bos_token
    assert byte_fallback.encode('Hello world', add_special_tokens=False) == ids[1:]
    assert byte_fallback.encode('<s>Hello world') == ids  # a rendered template's BOS is not doubled
    assert byte_fallback.chat_template is None


def test_eos_token_ids_merge_generation_config(tmp_path, byte_fallback):
    import shutil
    d = tmp_path / 'model'
    shutil.copytree(byte_fallback.model_dir, d)
    (d / 'generation_config.json').write_text('{"eos_token_id": [2, 0, 2]}')
    assert Tokenizer(str(d)).eos_token_ids == (2, 0)
    (d / 'generation_config.json').write_text('{"eos_token_id": 0}')
    assert Tokenizer(str(d)).eos_token_ids == (2, 0)


def test_token_ids_of_words(smol, metaspace):
    assert smol.token_ids_of_words(['<|im_end|>']) == [2]
    hello, space_hello = smol.encode('hello'), smol.encode(' hello')
    assert len(hello) == len(space_hello) == 1
    assert smol.token_ids_of_words(['hello', ' hello']) == hello + space_hello
    assert smol.token_ids_of_words(['no single token spells this']) == []
    # SentencePiece style: '▁the' decodes alone to 'the'
    the = metaspace.token_ids_of_words(['the'])
    assert metaspace.encode('the')[0] in the


# -- incremental detokenization -------------------------------------------------------------------

@pytest.mark.parametrize('text', TEXTS)
def test_increments_concatenate_to_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    for step in (1, 2, 3):
        pieces = stream(tok, ids, step=step)
        assert ''.join(pieces) == tok.decode(ids), (step, pieces)
        assert all('\ufffd' not in p for p in pieces)
        assert pieces[-1] == ''  # nothing valid is held back until the flush


def test_byte_fallback_tokens_are_held_until_complete(byte_fallback):
    ids = byte_fallback.encode('中', add_special_tokens=False)
    toks = byte_fallback.hf_tokenizer.convert_ids_to_tokens(ids)
    assert toks[-3:] == ['<0xE4>', '<0xB8>', '<0xAD>']
    pieces = stream(byte_fallback, ids)
    assert pieces[-4:] == ['', '', '中', ''] and ''.join(pieces) == '中'


def test_leading_space_of_a_later_token_is_kept(metaspace, byte_fallback):
    for tok in (metaspace, byte_fallback):
        ids = tok.encode('Hello world  again', add_special_tokens=False)
        pieces = stream(tok, ids)
        assert ''.join(pieces) == 'Hello world  again' == tok.decode(ids)


@pytest.mark.parametrize('skip', [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    bos, eos = tok.encode(tok.bos_token, add_special_tokens=False), [tok.eos_token_ids[0]]
    assert len(bos) == 1
    body = tok.encode('Hi there 😀 你好', add_special_tokens=False)
    ids = bos + body + eos + body + eos
    pieces = stream(tok, ids, skip_special_tokens=skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert ''.join(pieces) == expected
    assert (tok.eos_token in expected) is not skip


def test_added_non_special_token_survives_skip(byte_fallback):
    ids = byte_fallback.encode('call <tool> now', add_special_tokens=False)
    assert byte_fallback.decode(ids) == ''.join(stream(byte_fallback, ids))
    assert '<tool>' in byte_fallback.decode(ids)


def test_broken_utf8_at_the_end_is_flushed(smol):
    ids = smol.encode('😀', add_special_tokens=False)
    assert len(ids) >= 2
    partial = ids[:-1]  # the stream ends mid-character
    pieces = stream(smol, partial)
    assert all(p == '' for p in pieces[:-1]) and pieces[-1] == smol.decode(partial) != ''


def test_prompt_context_gives_generated_text_its_leading_space(tok):
    prompt = tok.encode('Say something nice', add_special_tokens=False)
    whole = tok.encode('Say something nice world again 😀', add_special_tokens=False)
    assert whole[:len(prompt)] == prompt
    generated = whole[len(prompt):]
    state = DetokenizeState.for_prompt(tok, prompt)
    pieces = stream(tok, generated, state=state)
    assert ''.join(pieces) == tok.decode(whole)[len(tok.decode(prompt)):] == ' world again 😀'
    # without the prompt the stream decodes as decode() of the generated ids alone, which for
    # SentencePiece-style tokenizers drops the first token's space
    alone = ''.join(stream(tok, generated))
    assert alone == tok.decode(generated)
    byte_level = isinstance(tok.hf_tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
    assert alone == (' world again 😀' if byte_level else 'world again 😀')


def test_prompt_context_starting_mid_character(byte_fallback):
    prompt = byte_fallback.encode('你好你', add_special_tokens=False)  # 9 byte tokens (+ '▁')
    generated = byte_fallback.encode('你好你 ok', add_special_tokens=False)[len(prompt):]
    state = DetokenizeState.for_prompt(byte_fallback, prompt)
    assert ''.join(stream(byte_fallback, generated, state=state)) == ' ok'


def test_work_per_call_stays_small(smol, monkeypatch):
    text = ' '.join(CORPUS[:5]) + ' 中文 😀 ' * 20
    ids = smol.encode(text, add_special_tokens=False) * 4
    windows = []
    real = smol._decode_window

    def spy(window):
        windows.append(len(window))
        return real(window)

    monkeypatch.setattr(smol, '_decode_window', spy)
    pieces = stream(smol, ids)
    assert ''.join(pieces) == smol.decode(ids)
    assert len(ids) > 300 and max(windows) <= 8


def test_rejects_a_shrinking_id_list(smol):
    state = DetokenizeState()
    _, state = smol.detokenize_incrementally([28120, 905], state)
    with pytest.raises(ValueError, match='same growing list'):
        smol.detokenize_incrementally([28120], state)


# -- stop strings ---------------------------------------------------------------------------------

def feed_all(matcher, pieces):
    out, stopped = [], False
    for p in pieces:
        text, stopped = matcher.feed(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return ''.join(out), stopped


def test_stop_string_across_pieces():
    m = StopStringMatcher(['STOP'])
    assert m.feed('Hello S') == ('Hello ', False)
    assert m.feed('T') == ('', False)
    assert m.feed('OP and more') == ('', True)
    assert m.feed('ignored') == ('', True) and m.matched == 'STOP'


def test_stop_string_include_in_output_and_false_alarm():
    assert feed_all(StopStringMatcher(['\n\n'], include_stop_str_in_output=True), ['a\n', '\nb']) == ('a\n\n', True)
    assert feed_all(StopStringMatcher(['\n\n'], include_stop_str=True), ['a\n', '\nb']) == ('a\n\n', True)
    m = StopStringMatcher(['<end>'])
    assert m.feed('x <en') == ('x ', False)
    assert m.feed('vy') == ('<envy', False)  # not a stop after all: released at once
    assert feed_all(StopStringMatcher(['<end>']), ['x <e', 'n']) == ('x <en', False)  # flushed at the end


def test_earliest_stop_string_wins():
    assert feed_all(StopStringMatcher(['bc', 'abcd']), ['xa', 'bcd']) == ('x', True)
    assert feed_all(StopStringMatcher(['abcd', 'bc']), ['xab', 'cz']) == ('xa', True)
    assert feed_all(StopStringMatcher([]), ['a', 'b']) == ('ab', False)


@pytest.mark.parametrize('stop', ['world!', ' wor', '!\n', '😀', 'o'])
def test_stop_string_on_detokenized_stream(smol, stop):
    text = 'Hello, world!\nBye 😀 again'
    ids = smol.encode(text)
    m = StopStringMatcher([stop])
    out, stopped = feed_all(m, stream(smol, ids))
    assert stopped and out == text[:text.index(stop)]
