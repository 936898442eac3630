"""The ``lmd`` command: ``lmd chat``, ``lmd convert``, ``lmd lite ...``, ``lmd serve ...``.

The top of the house: it may import anything, and nothing imports it. Each command is a
function whose signature is its command line and whose docstring is its ``--help``; those
that live in a serve module are named lazily (``lazy('module:function')``), so ``lmd --help``
imports none of gradio, uvicorn or openai. ``lmd.runner`` runs the tree: an unknown or
misspelled flag, a missing argument or a bad value is one ``lmd: error: ...`` line and exit
status 2, never a traceback.
"""
from __future__ import annotations

import sys

from .runner import Group, lazy, run_command


def calibrate(model: str, work_dir: str, *, calib_dataset: str = 'pydoc', calib_samples: int = 128,
              calib_seqlen: int = 512, batch_size: int = 4, dtype: str = 'float32'):
    """Run the model over calibration text layer by layer and write the statistics of what its
    linears see (per-channel max and mean of |x|, per-head K/V ranges) to WORK_DIR/calib_stats.safetensors.

    Args:
        model: a float Llama / Qwen2 / Qwen3 / Mistral model directory, or 'smollm2'.
        work_dir: the directory to write.
        calib_dataset: 'pydoc' (English prose shipped with Python), a .txt or .jsonl ("text" field) file,
            or a Hugging Face dataset id.
        calib_samples: how many windows of text.
        calib_seqlen: tokens per window.
        batch_size: windows run through a layer at once.
        dtype: float32, bfloat16 or float16 for the model while calibrating.
    """
    from lmd.lite.calibrate import calibrate
    print(f'wrote {calibrate(model, work_dir, calib_dataset, calib_samples, calib_seqlen, batch_size, dtype)}')


def auto_awq(model: str, work_dir: str, *, calib_dataset: str = 'pydoc', calib_samples: int = 128,
             calib_seqlen: int = 512, batch_size: int = 4, w_bits: int = 4, w_sym: bool = False,
             w_group_size: int = 128, search_scale: bool = True, search_clip: bool = True, rtn: bool = False,
             dtype: str = 'float32'):
    """Quantize a model's matmul weights to 4 bits with AWQ and write an AutoAWQ (GEMM) checkpoint
    that TurboMind loads (model_format 'awq').

    Args:
        model: a float Llama / Qwen2 / Qwen3 / Mistral model directory, or 'smollm2'.
        work_dir: the directory to write.
        calib_dataset: 'pydoc', a .txt or .jsonl ("text" field) file, or a Hugging Face dataset id.
        calib_samples: how many windows of text.
        calib_seqlen: tokens per window.
        batch_size: windows run through a layer at once.
        w_bits: weight bits; 4.
        w_sym: symmetric weights (no zero points; written with zeros of 8).
        w_group_size: input channels per quantization group, a multiple of 32 dividing every layer's in_features.
        search_scale: search AWQ's activation-scale exponent per group of linears (the default; LMDeploy
            makes this opt-in); --nosearch-scale uses the fixed exponent 0.5.
        search_clip: search a clipping range per output channel and group (AutoAWQ's auto_clip).
        rtn: plain round-to-nearest, without calibration or scales (the baseline).
        dtype: float32, bfloat16 or float16 for the model while calibrating.
    """
    from lmd.lite import awq
    if rtn:
        path = awq.quantize_rtn(model, work_dir, w_bits, w_sym, w_group_size, dtype)
    else:
        def log(i, groups):
            ratios = ', '.join(f"{g['linears']} {g['ratio']:.2f}" for g in groups)
            print(f'layer {i}: scale exponents {ratios}', file=sys.stderr, flush=True)
        path = awq.auto_awq(model, work_dir, calib_dataset, calib_samples, calib_seqlen, batch_size, w_bits,
                            w_sym, w_group_size, search_scale, search_clip, dtype, log)
    print(f'wrote {path}')


def gptq(model: str, work_dir: str, *, calib_dataset: str = 'pydoc', calib_samples: int = 128,
         calib_seqlen: int = 512, batch_size: int = 4, w_bits: int = 4, w_sym: bool = False, w_group_size: int = 128,
         damp: float = 0.1, search_scale: bool = True, dtype: str = 'float32'):
    """Quantize a model's matmul weights to 4 bits with GPTQ (each column's rounding error compensated
    by the columns after it, layer by layer on the quantized layers' outputs; AWQ's scale and clip
    searches first) and write an AutoGPTQ (v1) checkpoint.

    Args:
        model: a float Llama / Qwen2 / Qwen3 / Mistral model directory, or 'smollm2'.
        work_dir: the directory to write.
        calib_dataset: 'pydoc', a .txt or .jsonl ("text" field) file, or a Hugging Face dataset id.
        calib_samples: how many windows of text.
        calib_seqlen: tokens per window.
        batch_size: windows run through a layer at once.
        w_bits: weight bits; 4.
        w_sym: symmetric weights (zero points of 8).
        w_group_size: input channels per quantization group, a multiple of 32 dividing every layer's in_features.
        damp: added to the Hessian's diagonal, as a fraction of its mean (GPTQ's percdamp).
        search_scale: fold AWQ's activation scales and clip the weight ranges of each layer before GPTQ
            rounds it (the default); --nosearch-scale runs GPTQ alone.
        dtype: float32, bfloat16 or float16 for the model while calibrating.
    """
    from lmd.lite.gptq import gptq

    def log(i, seconds):
        print(f'layer {i}: {seconds:.1f} s', file=sys.stderr, flush=True)
    path = gptq(model, work_dir, calib_dataset, calib_samples, calib_seqlen, batch_size, w_bits, w_sym, w_group_size,
                damp, dtype, log, search_scale)
    print(f'wrote {path}')


def smooth_quant(model: str, work_dir: str, *, alpha: float = 0.5, calib_dataset: str = 'pydoc',
                 calib_samples: int = 128, calib_seqlen: int = 512, batch_size: int = 4, w_bits: int = 8,
                 dtype: str = 'float32'):
    """Smooth activation outliers into the weights (SmoothQuant) and quantize the matmuls to int8
    weights per output channel; activations are quantized per token at run time (W8A8). TurboMind
    loads the checkpoint (model_format 'w8a8').

    Args:
        model: a float Llama / Qwen2 / Qwen3 / Mistral model directory, or 'smollm2'.
        work_dir: the directory to write.
        alpha: how much of the activations' range moves into the weights, in [0, 1].
        calib_dataset: 'pydoc', a .txt or .jsonl ("text" field) file, or a Hugging Face dataset id.
        calib_samples: how many windows of text.
        calib_seqlen: tokens per window.
        batch_size: windows run through a layer at once.
        w_bits: weight bits; 8.
        dtype: float32, bfloat16 or float16 for the model while calibrating.
    """
    from lmd.lite.smooth_quant import smooth_quant
    path = smooth_quant(model, work_dir, alpha, calib_dataset, calib_samples, calib_seqlen, batch_size, w_bits,
                        dtype)
    print(f'wrote {path}')


def eval_ppl(model: str, *, text: str | None = None, model_format: str | None = None, quant_policy: int = 0,
             backend: str = 'auto', dtype: str = 'float32', window: int = 512, num_windows: int = 12, tp: int = 1,
             dp: int = 1, pp: int = 1, distributed_executor_backend: str | None = None,
             ray_address: str | None = None):
    """Perplexity on held-out text, measured the same way for every format: NUM_WINDOWS windows of
    WINDOW tokens from the start of the text, each scored alone from an empty cache.

    Args:
        model: a model directory (float, AWQ, W8A8), a .gguf file, or 'smollm2'.
        text: a UTF-8 .txt file, or a built-in held-out text: 'prose' (the default; English prose shipped with
            Python that calibration never uses) or 'code' (Python source of the standard library).
        model_format: None (from config.json), 'hf', 'awq', 'w8a8', 'gptq', 'compressed-tensors', 'fp8'
            or 'gguf'.
        quant_policy: KV cache: 0 as the model, 8 int8, 4 int4.
        backend: 'auto' (TurboMind where it runs the model, else PyTorch), 'turbomind', 'pytorch', or 'hf'
            (HF transformers, the float reference).
        dtype: float32, bfloat16, float16 or auto.
        window: tokens per window.
        num_windows: windows scored.
        tp: tensor parallel degree.
        dp: data-parallel replicas of the engine, each with its share of the cores, scoring DP windows at once.
        pp: pipeline parallel stages (PyTorch engine).
        distributed_executor_backend: how the PyTorch engine starts its tp x pp ranks: mp (local processes,
            the default) or ray.
        ray_address: the Ray cluster for the ranks (default: RAY_ADDRESS, else a local one); implies
            --distributed-executor-backend ray.
    """
    from lmd.lite.eval_ppl import eval_ppl
    engine_fields = dict(tp=tp, dp=dp, pp=pp, distributed_executor_backend=distributed_executor_backend,
                         ray_address=ray_address)
    if backend == 'auto':
        from .backend import autoget_backend, command_engine_config
        from .messages import PytorchEngineConfig
        from .model_path import prepare_model_dir
        if isinstance(command_engine_config(engine_fields, backend), PytorchEngineConfig):
            backend = 'pytorch'  # a PyTorch engine setting was given
        else:
            backend = autoget_backend(prepare_model_dir(model), model_format)
    r = eval_ppl(model, text, model_format=model_format, quant_policy=quant_policy, backend=backend, dtype=dtype,
                 window=window, num_windows=num_windows, engine_fields=engine_fields)
    print(f"perplexity {r['ppl']:.4f} ({r['backend']}, {r['model_format']}, quant_policy {r['quant_policy']}, "
          f"{r['dtype']}; {r['windows']} x {r['window']} tokens, {r['tokens']} scored, {r['seconds']:.1f} s)")


def convert(model_path: str, out_dir: str, *, backend: str | None = None, dtype: str = 'auto',
            overwrite: bool = False):
    """Convert a model into a directory an engine loads without its source.

    Without --backend (or with --backend pytorch): a .gguf file into an HF-style directory,
    model.safetensors (float32), config.json, tokenizer.json and tokenizer_config.json with the
    chat template; it loads in lmd and in transformers.

    With --backend turbomind: a .gguf file or an HF model directory (float or quantized) into
    TurboMind's own layout: turbomind/model.safetensors (q/k/v and gate/up fused, quantized
    matmuls packed as the kernels read them; a GGUF's matmuls stay at the file's own bit widths,
    whatever mix of block types it holds), turbomind/config.json
    (format version, sizes, each matmul's format, each tensor's digest) and the config and
    tokenizer files. It loads in TurboMind.

    Args:
        model_path: a .gguf file, 'smollm2' for the embedded model, or (--backend turbomind) a model directory.
        out_dir: the directory to write.
        backend: 'pytorch' (HF-style output, the default) or 'turbomind'.
        dtype: with --backend turbomind, the dtype of the float tensors: auto (the model's), float32,
            bfloat16 or float16.
        overwrite: replace out_dir if it already holds files.
    """
    from .convert import convert
    path = convert(model_path, out_dir, overwrite=overwrite, backend=backend, dtype=dtype)
    print(f'wrote {path}')


LITE = Group('lmd lite: quantize a float model and measure what it costs.',
             dict(calibrate=calibrate, auto_awq=auto_awq, gptq=gptq, smooth_quant=smooth_quant,
                  eval_ppl=eval_ppl))

SERVE = Group('lmd serve: put a model behind a server, or talk to one.', dict(
    api_server=lazy('lmd.serve.api_server:serve'),
    proxy=lazy('lmd.serve.proxy:proxy'),
    gradio=lazy('lmd.serve.gradio_app:serve_gradio'),
    api_client=lazy('lmd.serve.api_client:run_api_client'),
    triton=lazy('lmd.serve.triton:serve_triton'),
    triton_client=lazy('lmd.serve.triton_client:run_triton_client'),
))

LMD = Group('lmd: LLM inference and serving. Add --help to any command.',
            dict(chat=lazy('lmd.chat:chat'), convert=convert, lite=LITE, serve=SERVE))


def main(argv: list[str] | None = None) -> int:
    return run_command(LMD, argv, 'lmd')


if __name__ == '__main__':
    sys.exit(main())
