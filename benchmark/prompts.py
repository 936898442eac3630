"""The benchmarks' shared workload: real English prose cut into prompts of exact token lengths.

The prose is Python's own help text (``pydoc_data.topics.topics``, in the
standard library), so the workload needs no download and is the same on every
machine. The topics are joined in sorted-key order and tokenized once with the
model's ``tokenizer.json``; a prompt is a window of exactly ``input_len`` token
ids that starts at the beginning of a paragraph. Both lmd and transformers get
these ids (not text), so their prompt lengths agree to the token, and with
``ignore_eos`` and greedy decoding both generate exactly ``output_len`` tokens.
"""
from __future__ import annotations

import bisect
import os
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    output_len: int  # tokens to generate (max_new_tokens; all of them with EOS ignored)
    stop_at_eos: bool = False  # a chat request: it ends at the model's EOS, as a user's does

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


# Random models of a family, for figures of code paths no shipped model has (``--model tiny:<name>``):
# small but not toy-sized, SmolLM2's tokenizer (so the prose workload reads as text).
TINY_FAMILIES = {
    'mixtral': ('MixtralConfig', 'MixtralForCausalLM',
                dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2)),
}


def tiny_model_dir(name: str) -> str:
    """``~/.cache/lmd/tiny/<name>``: a random ``TINY_FAMILIES[name]`` model (seed 0, weights spread so
    the logits are not flat) in float32 with SmolLM2's tokenizer files; built once."""
    import shutil

    import torch
    import transformers

    from lmd.model_path import prepare_model_dir
    if name not in TINY_FAMILIES:
        raise ValueError(f'tiny:{name}: no such tiny model; choose from {sorted(TINY_FAMILIES)}')
    out = os.path.join(os.path.expanduser('~/.cache/lmd/tiny'), name)
    if os.path.isfile(os.path.join(out, 'config.json')):
        return out
    config_class, model_class, sizes = TINY_FAMILIES[name]
    tok_dir = prepare_model_dir('smollm2')
    config = getattr(transformers, config_class)(vocab_size=49152, max_position_embeddings=2048, bos_token_id=1,
                                                 eos_token_id=2, tie_word_embeddings=False, **sizes)
    config.architectures = [model_class]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param)) if 'norm' in pname else param.normal_(0, 0.05)
    tmp = out + '.tmp'
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ('tokenizer.json', 'tokenizer_config.json'):
        shutil.copy(os.path.join(tok_dir, f), tmp)
    os.replace(tmp, out)
    return out


def resolve_model_dir(model: str) -> str:
    """The HF directory (float32 safetensors) that both lmd and transformers load; ``tiny:<name>``: a
    random model of a family (``tiny_model_dir``)."""
    if model.startswith('tiny:'):
        return tiny_model_dir(model.removeprefix('tiny:'))
    if os.path.isfile(os.path.join(model, 'config.json')):
        return os.path.abspath(model)  # already an HF directory
    from lmd.model_path import prepare_model_dir
    return prepare_model_dir(model)


class ProseCorpus:
    """``pydoc_data.topics`` as one token stream, with the token index of every paragraph start."""

    def __init__(self, model_dir: str):
        from pydoc_data.topics import topics

        from tokenizers import Tokenizer  # the model's own tokenizer.json, read without transformers
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, 'tokenizer.json'))
        text = '\n\n'.join(topics[k].strip() for k in sorted(topics))
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        self.token_ids: list[int] = enc.ids
        para_chars, pos = [0], text.find('\n\n')
        while pos != -1:
            para_chars.append(pos + 2)
            pos = text.find('\n\n', pos + 2)
        # paragraph starts as token indices: the first token whose span begins at or after the start
        starts = [o[0] for o in enc.offsets]
        self.paragraph_starts = sorted({bisect.bisect_left(starts, c) for c in para_chars} - {len(starts)})

    def window(self, rng: random.Random, length: int) -> tuple[int, ...]:
        """``length`` consecutive tokens from a random paragraph start."""
        if length > len(self.token_ids):
            raise ValueError(f'a {length}-token prompt is longer than the whole corpus ({len(self.token_ids)})')
        limit = bisect.bisect_right(self.paragraph_starts, len(self.token_ids) - length)
        start = self.paragraph_starts[rng.randrange(limit)]
        return tuple(self.token_ids[start:start + length])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def _length(rng: random.Random, spec: tuple[int, int]) -> int:
    lo, hi = spec
    return lo if lo == hi else rng.randint(lo, hi)


def parse_range(value: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32,512' or '32:512' -> (32, 512), inclusive."""
    parts = value.replace(':', ',').split(',')
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f'expected N or LO,HI token counts, got {value!r}') from None
    if len(nums) == 1:
        nums = nums * 2
    if len(nums) != 2 or not 1 <= nums[0] <= nums[1]:
        raise ValueError(f'expected N or LO,HI with 1 <= LO <= HI, got {value!r}')
    return nums[0], nums[1]


def make_prompts(model_dir: str, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                 seed: int = 0) -> list[Prompt]:
    """``num_prompts`` prompts, lengths drawn uniformly from the inclusive ranges, fixed by ``seed``."""
    corpus = ProseCorpus(model_dir)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n_in = _length(rng, input_len)
        n_out = _length(rng, output_len)
        prompts.append(Prompt(corpus.window(rng, n_in), n_out))
    return prompts


# the short chat workload: questions a user types, one turn each (templates x subjects, in a fixed order)
CHAT_TEMPLATES = [
    'What is {}? Answer in two sentences.',
    'Give me three quick facts about {}.',
    'Explain {} to a ten-year-old.',
    'Write a short poem about {}.',
    'What are the pros and cons of {}?',
    'How would you describe {} in one paragraph?',
    'Why do people care about {}?',
    'Suggest a fun weekend activity related to {}.',
]
CHAT_SUBJECTS = ['the ocean', 'coffee', 'the moon', 'bicycles', 'volcanoes', 'libraries', 'honey bees',
                 'rainbows']


def make_chat_prompts(model_dir: str, num_prompts: int, max_new_tokens: int) -> list[Prompt]:
    """``num_prompts`` one-turn chat requests through the model's chat template (its system prompt
    included), each ending at EOS or after ``max_new_tokens``: what a new user's first requests look like."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = [t.format(s) for s in CHAT_SUBJECTS for t in CHAT_TEMPLATES]
    prompts = []
    for i in range(num_prompts):
        q = questions[i % len(questions)]
        ids = tok.apply_chat_template([{'role': 'user', 'content': q}], add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = ids['input_ids']
        prompts.append(Prompt(tuple(ids), max_new_tokens, stop_at_eos=True))
    return prompts


def describe(prompts: list[Prompt]) -> dict:
    def spread(lens: list[int]) -> dict:
        return {'min': min(lens), 'max': max(lens), 'mean': round(sum(lens) / len(lens), 1), 'total': sum(lens)}
    outs = [p.output_len for p in prompts]
    chat = prompts[0].stop_at_eos
    return {
        'source': ('short chat: CHAT_TEMPLATES x CHAT_SUBJECTS (benchmark/prompts.py) through the chat template, '
                   'greedy, each request ending at EOS or max_new_tokens') if chat else
                  'pydoc_data.topics.topics (stdlib), windows of token ids from paragraph starts',
        'num_prompts': len(prompts),
        'input_tokens': spread([p.input_len for p in prompts]),
        **({'max_new_tokens': max(outs)} if chat else {'output_tokens': spread(outs)}),
    }


if __name__ == '__main__':  # show a few prompts: python benchmark/prompts.py [MODEL_DIR]
    import sys
    model_dir = sys.argv[1] if len(sys.argv) > 1 else resolve_model_dir('smollm2')
    corpus = ProseCorpus(model_dir)
    ps = make_prompts(model_dir, 4, (32, 64), (16, 256))
    for p in ps:
        print(f'--- {p.input_len} in, {p.output_len} out\n{corpus.decode(p.token_ids)}')
    print(describe(ps))
