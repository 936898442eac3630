"""``lmd chat``: a terminal conversation that streams its answers.

The conversation is an interactive session: the engine keeps its KV cache
between turns, so each turn prefills only what the user just typed.
"""
from __future__ import annotations

import sys

from .backend import check_backend, command_engine_config, command_speculative_config
from .messages import ChatTemplateConfig, GenerationConfig
from .prompt_loop import HELP, read_turns


def chat(model_path: str | None = None, *, backend: str = 'auto', chat_template: str | None = None,
         system: str | None = None, session_len: int | None = None, cache_max_entry_count: float | None = None,
         enable_prefix_caching: bool = False, dtype: str = 'auto', quant_policy: int = 0,
         num_threads: int | None = None, tp: int = 1, dp: int = 1, pp: int = 1,
         distributed_executor_backend: str | None = None, ray_address: str | None = None,
         int8_activations: bool = False, max_new_tokens: int = 1024, do_sample: bool = False,
         temperature: float = 0.8, top_p: float = 1.0, top_k: int = 50, repetition_penalty: float = 1.0,
         random_seed: int | None = None, speculative_algorithm: str | None = None,
         speculative_num_draft_tokens: int | None = None, speculative_draft_model: str | None = None) -> None:
    """Chat with a model in the terminal; answers stream as they are generated.

    Type /reset to start a new conversation and /exit (or Ctrl-D) to leave.

    Args:
        model_path: an HF model directory, a .gguf file, or 'smollm2' (the default, embedded model).
        backend: 'auto' (TurboMind where it runs the model, else PyTorch), 'turbomind' or 'pytorch'.
        chat_template: a built-in template name (chatml, llama3, qwen2, internlm2, base) to use
            instead of the model's own.
        system: a system prompt for the conversation.
        session_len: the longest conversation in tokens (default: the model's context, at most 8192).
        cache_max_entry_count: the fraction of free memory the KV cache may take.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        dtype: auto, float32, bfloat16 or float16.
        quant_policy: KV cache quantization: 0 none, 8 int8, 4 int4.
        num_threads: CPU threads for the engine (default: all cores).
        tp: tensor parallel degree.
        dp: data-parallel replicas of the engine, each with NUM_THREADS // DP threads.
        pp: pipeline parallel stages (PyTorch engine).
        distributed_executor_backend: how the PyTorch engine starts its tp x pp ranks: mp (local processes,
            the default) or ray.
        ray_address: the Ray cluster for the ranks (default: RAY_ADDRESS, else a local one); implies
            --distributed-executor-backend ray.
        int8_activations: TurboMind: quantized matmuls take int8 activations as llama.cpp's (faster on CPUs).
        max_new_tokens: the most tokens one answer may have.
        do_sample: sample instead of greedy decoding.
        temperature: sampling temperature (with --do-sample).
        top_p: nucleus sampling mass (with --do-sample).
        top_k: sample among the k likeliest tokens (with --do-sample).
        repetition_penalty: >1 discourages repeating tokens.
        random_seed: makes sampling reproducible.
        speculative_algorithm: speculative decoding: ngram (drafts by prompt lookup) or draft_target.
        speculative_num_draft_tokens: tokens drafted per step (default 4).
        speculative_draft_model: the draft model, with draft_target.
    """
    from .api import pipeline
    check_backend(backend)  # before the model loads
    speculative = command_speculative_config(speculative_algorithm, speculative_num_draft_tokens,
                                             speculative_draft_model)
    fields = dict(session_len=session_len, cache_max_entry_count=cache_max_entry_count,
                  enable_prefix_caching=enable_prefix_caching, dtype=dtype, num_threads=num_threads,
                  quant_policy=quant_policy, speculative_config=speculative, tp=tp, dp=dp, pp=pp,
                  distributed_executor_backend=distributed_executor_backend, ray_address=ray_address)
    config = command_engine_config(fields, backend, int8_activations)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                           top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, random_seed=random_seed)
    template = ChatTemplateConfig(model_name=chat_template) if chat_template else None
    pipe = pipeline(model_path, backend_config=config, chat_template_config=template, backend=backend)
    out = sys.stdout
    try:
        print(f'lmd chat: {pipe.async_engine.model_dir}. {HELP}', file=out, flush=True)
        session = pipe.new_session(system)

        def reset():
            nonlocal session
            pipe.end_session(session)
            session = pipe.new_session(system)

        for message in read_turns(reset, out):
            try:
                for r in pipe.stream_chat(message, session, gen):
                    out.write(r.text)
                    out.flush()
                    last = r
                if last.finish_reason == 'length':
                    out.write(' [stopped: max_new_tokens or session_len reached; /reset to start over]')
                out.write('\n')
                out.flush()
            except ValueError as e:  # e.g. the conversation outgrew session_len
                print(f'\nlmd: {e}. Type /reset to start a new conversation.', file=out, flush=True)
    except KeyboardInterrupt:  # while an answer streams: leave (the request is aborted)
        pass
    finally:
        pipe.close()
