"""Speculative decoding at batch 1: each engine with and without n-gram drafting (prompt lookup), and
llama.cpp with and without its prompt-lookup decoding, on the same input-grounded chat prompts.

    python benchmark/profile_speculative.py                          # SmolLM2's Q4_1 GGUF, both engines
    python benchmark/profile_speculative.py --backends pytorch --no-llamacpp --num-draft-tokens 4,8
    python benchmark/profile_speculative.py --draft-model PATH   # draft_target too, both engines

The prompts ask the model to copy, to continue and to summarise a passage of English prose
(``prompts.py``'s text), what drafting from the context is for: a copy can take most drafts, a
summary few. Each answer is greedy, up to ``--max-new-tokens``; decode tokens/s is (tokens - 1)
over the time from the first token to the last. ``acceptance_length`` is the mean tokens a
verification step gives (1 + accepted drafts / drafts, from the engine's counters);
``same_output`` says whether the answer equals the one without speculation (it must, for greedy);
``all`` is the workload's: its decode tokens over its decode time, all tasks together. lmd's engines
run with ``adaptive_draft_length`` (the default); ``--fixed`` adds each draft length fixed. With
``--repeats N`` each engine's sides with and without drafts run N times in alternating order, each
task's rate the best of its runs (one run of each, in turn, moved a 4-bit ratio by ±0.1).
llama.cpp runs the same GGUF through llama-cpp-python: ``Llama`` without a draft model, then with
``LlamaPromptLookupDecoding(num_pred_tokens=K)``, streaming the same rendered prompt. On CPUs with AMX
its repacked weight buffers crash (llama.cpp 0.3.36): they are turned off there, and the report says so.

Prints one JSON object on stdout (progress on stderr) and a markdown table on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DEFAULT_THREADS, alternating, emit, llamacpp_extra_bufts, load_average, log,  # noqa: E402
                    set_threads)

TASKS = {
    'copy': 'Copy the following text exactly, word for word, and write nothing else.\n\n{passage}',
    'continue': 'Repeat the following text, then continue it with two more sentences.\n\n{passage}',
    'summarise': 'Summarise the following text in three sentences.\n\n{passage}',
}


def passage(num_words: int = 120) -> str:
    """The first paragraph of the benchmarks' prose that has at least ``num_words`` words, cut to about that."""
    import pydoc_data.topics
    for key in sorted(pydoc_data.topics.topics):
        for para in pydoc_data.topics.topics[key].split('\n\n'):
            words = ' '.join(para.split()).split(' ')
            if len(words) >= num_words and para.strip()[:1].isalpha():
                return ' '.join(words[:num_words])
    raise RuntimeError('no paragraph long enough')


def lmd_side(model: str, backend: str, k: int | None, messages: dict, max_new_tokens: int,
             draft_model: str | None = None, adaptive: bool = True) -> dict:
    """One engine, with ``k`` drafted tokens a step (None: no speculation) by prompt lookup, or by
    ``draft_model``: per task its timing and answer."""
    from lmd import GenerationConfig, SpeculativeConfig, pipeline
    from lmd.backend import CONFIGS
    spec = None
    if k:
        spec = SpeculativeConfig(num_speculative_tokens=k, adaptive_draft_length=adaptive,
                                 **(dict(method='draft_target', model=draft_model) if draft_model else {}))
    config = CONFIGS[backend](session_len=2048, speculative_config=spec)
    out = {}
    with pipeline(model, backend=backend, backend_config=config) as pipe:
        gen = GenerationConfig(max_new_tokens=max_new_tokens)
        pipe(messages['copy'], GenerationConfig(max_new_tokens=8))  # warm up
        for task, msgs in messages.items():
            before = pipe.async_engine.stats()
            start, first, n, text = time.perf_counter(), None, 0, ''
            for r in pipe.stream_infer(msgs, gen):
                if r.generate_token_len and first is None:
                    first = time.perf_counter()
                n, text = r.generate_token_len, text + r.text
            end = time.perf_counter()
            after = pipe.async_engine.stats()
            drafts = after.spec_num_drafts - before.spec_num_drafts
            accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            out[task] = dict(tokens=n, ttft_s=round(first - start, 4), decode_tok_s=round((n - 1) / (end - first), 1),
                             acceptance_length=round(1 + accepted / drafts, 2) if drafts else None,
                             drafted=after.spec_num_draft_tokens - before.spec_num_draft_tokens, accepted=accepted,
                             text=text)
    return out


def llamacpp_side(path: str, k: int | None, prompts: dict, max_new_tokens: int, threads: int,
                  use_extra_bufts: bool) -> dict:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from compare_llamacpp import open_llama
    llm = open_llama(path, use_extra_bufts, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                     draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None)
    out = {}
    llm.create_completion(prompts['copy'], max_tokens=8, temperature=0.0)  # warm up
    for task, prompt in prompts.items():
        start, first, n, text = time.perf_counter(), None, 0, ''
        for chunk in llm.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.0, stream=True):
            if first is None:
                first = time.perf_counter()
            n += 1
            text += chunk['choices'][0]['text']
        end = time.perf_counter()
        out[task] = dict(tokens=n, ttft_s=round(first - start, 4), decode_tok_s=round((n - 1) / (end - first), 1),
                         text=text)
    return out


def against(side: dict, base: dict) -> None:
    """Each task's speedup over ``base`` (the same engine without speculation) and whether its answer is the
    same; under 'all', the workload's: its decode tokens over its decode time, all tasks together."""
    for task, r in side.items():
        r['same_output'] = r['text'] == base[task]['text']
        r['speedup'] = round(r['decode_tok_s'] / base[task]['decode_tok_s'], 2)

    def tasks(s: dict) -> list[dict]:
        return [r for t, r in s.items() if t != 'all']

    def rate(rs: list[dict]) -> float:
        return sum(r['tokens'] - 1 for r in rs) / sum((r['tokens'] - 1) / r['decode_tok_s'] for r in rs)
    rs, r = tasks(side), rate(tasks(side))
    side['all'] = dict(tokens=sum(x['tokens'] for x in rs), decode_tok_s=round(r, 1),
                       speedup=round(r / rate(tasks(base)), 2), same_output=all(x['same_output'] for x in rs), text='')


def repeated(run_side, keys: list, repeats: int) -> dict:
    """{key: run_side(key)} over ``repeats`` runs of every key, their order reversed each other time, each
    task's figures from its run with the best decode rate (the answers are the same in every run): a
    drift of the machine's speed then favours neither the speculating side nor its baseline."""
    got = {k: [] for k in keys}
    for _, k in alternating(keys, repeats):
        got[k].append(run_side(k))
    return {k: {task: max((s[task] for s in sides), key=lambda r: r['decode_tok_s']) for task in sides[0]}
            for k, sides in got.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default=None, help="a GGUF file or model directory (default: SmolLM2's Q4_1 GGUF)")
    p.add_argument('--backends', default='pytorch,turbomind')
    p.add_argument('--num-draft-tokens', default='4', help='drafted tokens per step, several separated by commas')
    p.add_argument('--max-new-tokens', type=int, default=192)
    p.add_argument('--num-threads', type=int, default=DEFAULT_THREADS)
    p.add_argument('--no-llamacpp', action='store_true')
    p.add_argument('--repeats', type=int, default=1,
                   help='run every side with and without n-gram drafts this many times, alternating; each task '
                        'its best (the --fixed and --draft-model sides run once)')
    p.add_argument('--fixed', action='store_true',
                   help='also run each draft length fixed (adaptive_draft_length=False: every step drafts all it can)')
    p.add_argument('--draft-model', default=None,
                   help='also run draft_target with this draft model (any model of the same vocabulary)')
    p.add_argument('--f16', action='store_true',
                   help='target: the shipped GGUF written at F16 (the copy compare_llamacpp.py writes, '
                        'gguf_files.f16_gguf); draft model: the shipped Q4_1 file unless --draft-model names another')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.num_threads)
    load_start = load_average()
    from gguf_files import f16_gguf, shipped_gguf
    model = args.model or shipped_gguf()
    if args.f16:
        model, args.draft_model = f16_gguf(model)[0], args.draft_model or model
    text = passage()
    messages = {task: [{'role': 'user', 'content': t.format(passage=text)}] for task, t in TASKS.items()}
    ks = [int(k) for k in args.num_draft_tokens.split(',')]
    report = dict(model=model, num_threads=args.num_threads, max_new_tokens=args.max_new_tokens, passage=text,
                  repeats=args.repeats, runs=[])
    for backend in args.backends.split(','):
        def one(k, backend=backend):
            log(f'{backend}, draft tokens {k}')
            return lmd_side(model, backend, k, messages, args.max_new_tokens)
        sides = repeated(one, [None, *ks], args.repeats)
        base = sides[None]
        for k, side in sides.items():
            against(side, base)
            report['runs'].append(dict(engine=f'lmd {backend}', draft_tokens=k, tasks=side))
        for k in ks if args.fixed else []:
            log(f'{backend}, draft tokens {k}, fixed length')
            side = lmd_side(model, backend, k, messages, args.max_new_tokens, adaptive=False)
            against(side, base)
            report['runs'].append(dict(engine=f'lmd {backend}, fixed length', draft_tokens=k, tasks=side))
        if args.draft_model:
            for k in ks:
                log(f'{backend}, draft model {args.draft_model}, draft tokens {k}')
                side = lmd_side(model, backend, k, messages, args.max_new_tokens, args.draft_model)
                against(side, base)
                report['runs'].append(dict(engine=f'lmd {backend} + draft model', draft_tokens=k, tasks=side))
    if not args.no_llamacpp and model.endswith('.gguf'):
        template = _TemplateOnly(model)
        rendered = {task: template.render_chat(msgs) for task, msgs in messages.items()}
        extra = llamacpp_extra_bufts()
        report['llamacpp_extra_bufts'] = extra
        def one_llamacpp(k):
            log(f'llama.cpp, prompt lookup {k}')
            return llamacpp_side(model, k, rendered, args.max_new_tokens, args.num_threads, extra)
        sides = repeated(one_llamacpp, [None, *ks], args.repeats)
        for k, side in sides.items():
            against(side, sides[None])
            report['runs'].append(dict(engine='llama.cpp', draft_tokens=k, tasks=side))
    table(report)
    for run in report['runs']:
        for r in run['tasks'].values():
            r.pop('text')
    emit(report, load_start)
    return 0


class _TemplateOnly:
    """The model's tokenizer and chat template without an engine: the prompt llama.cpp gets as text."""

    def __init__(self, model: str):
        from lmd.chat_template import get_chat_template
        from lmd.model_path import prepare_model_dir
        from lmd.tokenizer import Tokenizer
        self.tokenizer = Tokenizer(prepare_model_dir(model))
        self.chat_template = get_chat_template(self.tokenizer, None)

    def render_chat(self, messages) -> str:
        return self.chat_template.render(messages, add_generation_prompt=True)


def table(report: dict) -> None:
    log('| engine | draft tokens | task | tokens | decode tok/s | speedup | acceptance length | same output |')
    log('| --- | --- | --- | --- | --- | --- | --- | --- |')
    for run in report['runs']:
        for task, r in run['tasks'].items():
            log(f"| {run['engine']} | {run['draft_tokens'] or '-'} | {task} | {r['tokens']} | {r['decode_tok_s']} | "
                f"{r['speedup']} | {r.get('acceptance_length') or '-'} | {r['same_output']} |")


if __name__ == '__main__':
    sys.exit(main())
