"""The ``lmd`` command (built with fire): ``lmd chat``, ``lmd convert [--backend turbomind]``,
``lmd lite calibrate | auto_awq | smooth_quant | eval_ppl``.

Every subcommand answers ``--help``. A user's mistake (a missing model, a bad
flag value) prints one ``lmd: error: ...`` line and exits 2, never a traceback.
"""
from __future__ import annotations

import os
import sys

from .errors import LmdError


def _engine_config(backend: str, **fields):
    from .messages import PytorchEngineConfig, TurbomindEngineConfig
    fields = {k: v for k, v in fields.items() if v is not None}
    if backend == 'pytorch':
        return PytorchEngineConfig(**fields)
    if backend == 'turbomind':
        return TurbomindEngineConfig(**fields)
    raise ValueError(f"--backend {backend!r} is invalid: allowed values are 'pytorch', 'turbomind'")


class Lite:
    """lmd lite: quantize a float model and measure what it costs. Subcommands: calibrate, auto_awq,
    smooth_quant, eval_ppl."""

    def calibrate(self, model: str, work_dir: str, calib_dataset: str = 'pydoc', calib_samples: int = 128,
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

    def auto_awq(self, model: str, work_dir: str, calib_dataset: str = 'pydoc', calib_samples: int = 128,
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

    def smooth_quant(self, model: str, work_dir: str, alpha: float = 0.5, calib_dataset: str = 'pydoc',
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

    def eval_ppl(self, model: str, text: str | None = None, model_format: str | None = None, quant_policy: int = 0,
                 backend: str = 'turbomind', dtype: str = 'float32', window: int = 512, num_windows: int = 12):
        """Perplexity on held-out text, measured the same way for every format: NUM_WINDOWS windows of
        WINDOW tokens from the start of the text, each scored alone from an empty cache.

        Args:
            model: a model directory (float, AWQ, W8A8), a .gguf file, or 'smollm2'.
            text: a UTF-8 .txt file; by default English prose shipped with Python that calibration never uses.
            model_format: None (from config.json), 'hf', 'awq', 'w8a8' or 'gguf'.
            quant_policy: KV cache: 0 as the model, 8 int8, 4 int4.
            backend: 'turbomind', 'pytorch', or 'hf' (HF transformers, the float reference).
            dtype: float32, bfloat16, float16 or auto.
            window: tokens per window.
            num_windows: windows scored.
        """
        from lmd.lite.eval_ppl import eval_ppl
        r = eval_ppl(model, text, model_format=model_format, quant_policy=quant_policy, backend=backend, dtype=dtype,
                     window=window, num_windows=num_windows)
        print(f"perplexity {r['ppl']:.4f} ({r['backend']}, {r['model_format']}, quant_policy {r['quant_policy']}, "
              f"{r['dtype']}; {r['windows']} x {r['window']} tokens, {r['tokens']} scored, {r['seconds']:.1f} s)")


class Serve:
    """lmd serve: put a model behind a server. Subcommands: api_server, proxy, gradio, api_client, triton,
    triton_client."""

    def api_server(self, model_path: str | None = None, backend: str | None = None, server_name: str = '0.0.0.0',
                   server_port: int = 23333, api_keys=None, model_name: str | None = None,
                   chat_template: str | None = None, max_concurrent_requests: int | None = None,
                   tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                   proxy_url: str | None = None, allow_origins=None, allow_credentials: bool = False,
                   allow_methods='*', allow_headers='*', session_len: int | None = None,
                   max_batch_size: int | None = None, cache_max_entry_count: float | None = None,
                   cache_block_seq_len: int | None = None, enable_prefix_caching: bool = False,
                   quant_policy: int = 0, model_format: str | None = None, tp: int = 1, dtype: str = 'auto',
                   num_threads: int | None = None, device: str | None = None, log_level: str = 'INFO'):
        """Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
        /v1/models, /generate, /v1/encode, /v1/decode, /health, /metrics (docs at /docs).

        Args:
            model_path: an HF model directory, a .gguf file, an AWQ/W8A8 directory, or 'smollm2' (the default).
            backend: 'turbomind' or 'pytorch' (default: TurboMind for what only it runs, else PyTorch).
            server_name: the address to listen on.
            server_port: the port to listen on.
            api_keys: keys clients must send as "Authorization: Bearer KEY"; several separated by commas.
            model_name: the name clients use in "model" (default: the model path's last part).
            chat_template: a built-in template name (chatml, llama3, qwen2, internlm2, base) instead of the model's.
            max_concurrent_requests: requests generating at once; more wait in the server.
            tool_call_parser: how to read tool calls from the output: qwen (hermes), llama3, internlm.
            reasoning_parser: split <think> blocks into reasoning_content: deepseek-r1, qwen-qwq (qwen3).
            proxy_url: a `lmd serve proxy` to register with at start (and leave at exit).
            allow_origins: CORS origins allowed, separated by commas ('*' for any).
            allow_credentials: CORS: allow credentials.
            allow_methods: CORS methods, separated by commas.
            allow_headers: CORS headers, separated by commas.
            session_len: the longest context in tokens (default: the model's, at most 8192).
            max_batch_size: requests the engine runs at once.
            cache_max_entry_count: the fraction of free memory the KV cache may take.
            cache_block_seq_len: tokens per KV cache block.
            enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
            quant_policy: KV cache quantization: 0 none, 8 int8, 4 int4.
            model_format: hf, awq, w8a8 or gguf (default: from the model).
            tp: tensor parallel degree.
            dtype: auto, float32, bfloat16 or float16.
            num_threads: CPU threads for the engine (default: all cores).
            device: cpu or cuda.
            log_level: DEBUG, INFO, WARNING or ERROR.
        """
        from lmd.serve.api_server import serve
        serve(model_path, backend=backend, server_name=server_name, server_port=server_port, api_keys=api_keys,
              model_name=model_name, chat_template=chat_template, max_concurrent_requests=max_concurrent_requests,
              tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, proxy_url=proxy_url,
              allow_origins=allow_origins, allow_credentials=allow_credentials, allow_methods=allow_methods,
              allow_headers=allow_headers, session_len=session_len, max_batch_size=max_batch_size,
              cache_max_entry_count=cache_max_entry_count, cache_block_seq_len=cache_block_seq_len,
              enable_prefix_caching=enable_prefix_caching, quant_policy=quant_policy, model_format=model_format,
              tp=tp, dtype=dtype, num_threads=num_threads, device=device, log_level=log_level)


    def proxy(self, server_name: str = '0.0.0.0', server_port: int = 8000,
              routing_strategy: str = 'min_expected_latency', api_keys=None, health_check_interval: float = 5.0,
              health_check_timeout: float = 5.0, nodes=None, log_level: str = 'INFO'):
        """Route OpenAI requests across api_servers: they join with --proxy-url or POST /nodes/add
        ({"url": ...}); /nodes/status lists them, /nodes/remove drops one. A node whose /health fails
        gets no requests until it answers again.

        Args:
            server_name: the address to listen on.
            server_port: the port to listen on.
            routing_strategy: random (weighted by node speed), min_expected_latency (least unfinished
                requests x mean latency) or min_observed_latency (least mean latency).
            api_keys: keys clients must send as "Authorization: Bearer KEY", separated by commas; the header
                goes on to the nodes unchanged.
            health_check_interval: seconds between health probes of the nodes.
            health_check_timeout: seconds a node's /health may take before it counts as down.
            nodes: api_server URLs to register at start, separated by commas.
            log_level: DEBUG, INFO, WARNING or ERROR.
        """
        from lmd.serve.proxy import proxy
        proxy(server_name=server_name, server_port=server_port, routing_strategy=routing_strategy,
              api_keys=api_keys, health_check_interval=health_check_interval,
              health_check_timeout=health_check_timeout, nodes=nodes, log_level=log_level)

    def gradio(self, model_or_url: str | None = None, server_name: str = '0.0.0.0', server_port: int = 6006,
               backend: str | None = None, api_key: str | None = None, chat_template: str | None = None,
               session_len: int | None = None, cache_max_entry_count: float | None = None,
               enable_prefix_caching: bool = False, quant_policy: int = 0, dtype: str = 'auto',
               num_threads: int | None = None, max_concurrent: int = 64, share: bool = False):
        """A web chat (Gradio) on a model run here, on an api_server or on Triton: streamed answers, Stop, Clear,
        a system prompt, temperature / top-p / max-new-tokens; each browser session is its own conversation.

        Args:
            model_or_url: a model path or 'smollm2' (the default) to run here, an api_server URL http://HOST:PORT,
                or lmd's models on a Triton Inference Server, triton://HOST:PORT[/MODEL] (its gRPC port).
            server_name: the address the page listens on.
            server_port: the port the page listens on.
            backend: 'turbomind' or 'pytorch', for a local model.
            api_key: the api_server's key, for a URL.
            chat_template: a built-in template name instead of the model's, for a local model.
            session_len: the longest conversation in tokens, for a local model.
            cache_max_entry_count: the fraction of free memory the KV cache may take, for a local model.
            enable_prefix_caching: reuse KV blocks of shared prompt prefixes, for a local model.
            quant_policy: KV cache quantization (0, 8, 4), for a local model.
            dtype: auto, float32, bfloat16 or float16, for a local model.
            num_threads: CPU threads for a local engine (default: all cores).
            max_concurrent: answers generated at once, across all users.
            share: ask Gradio for a public link (needs the internet).
        """
        from lmd.serve.gradio_app import run_gradio

        from .messages import ChatTemplateConfig
        local = not (isinstance(model_or_url, str) and model_or_url.startswith(('http://', 'https://', 'triton://')))
        config = None
        if local:
            fields = dict(session_len=session_len, cache_max_entry_count=cache_max_entry_count,
                          enable_prefix_caching=enable_prefix_caching, quant_policy=quant_policy, dtype=dtype,
                          num_threads=num_threads)
            if backend is not None:
                config = _engine_config(backend, **fields)
            elif any(v not in (None, False, 0, 'auto') for v in fields.values()):
                raise ValueError('engine flags need --backend turbomind or --backend pytorch')
        template = ChatTemplateConfig(model_name=chat_template) if chat_template and local else None
        run_gradio(model_or_url, server_name=server_name, server_port=server_port, backend=backend,
                   backend_config=config, chat_template_config=template, api_key=api_key, share=share,
                   max_concurrent=max_concurrent)

    def api_client(self, api_server_url: str, api_key: str | None = None, model: str | None = None,
                   system: str | None = None, temperature: float = 0.7, top_p: float = 1.0, max_tokens: int = 512):
        """Chat in the terminal with any OpenAI-compatible server; /reset starts over, /exit (or Ctrl-D) leaves.

        Args:
            api_server_url: the server, http://HOST:PORT (a trailing /v1 is fine).
            api_key: the key the server wants ("Authorization: Bearer KEY").
            model: the model name to ask for (default: the first the server lists).
            system: a system prompt for the conversation.
            temperature: sampling temperature; 0 is greedy.
            top_p: nucleus sampling mass.
            max_tokens: the most tokens one answer may have.
        """
        from lmd.serve.api_client import run_api_client
        run_api_client(api_server_url, api_key=api_key, model=model, system=system, temperature=temperature,
                       top_p=top_p, max_tokens=max_tokens)

    def triton(self, model_path: str | None = None, model_repository: str = 'triton_repository',
               backend: str = 'turbomind', models: str = 'preprocessing,engine,postprocessing,ensemble,lmd_model',
               chat_template: str | None = None, launch: bool = False, server_name: str = '127.0.0.1',
               http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
               postprocessing_instances: int = 1, session_len: int | None = None,
               max_batch_size: int | None = None, cache_max_entry_count: float | None = None,
               cache_block_seq_len: int | None = None, enable_prefix_caching: bool = False,
               quant_policy: int = 0, model_format: str | None = None, dtype: str = 'auto',
               num_threads: int | None = None, device: str | None = None):
        """Write a Triton Inference Server model repository for a model; --launch also runs tritonserver on it.

        The repository holds ensemble (preprocessing -> engine -> postprocessing) and lmd_model (the whole
        pipeline in one model); both take a prompt and stream text over gRPC (see `lmd serve triton_client`).
        config.pbtxt files point at the model; nothing is copied. tritonserver comes from
        pip install "lmd[triton]".

        Args:
            model_path: an HF model directory, a .gguf file, an AWQ/W8A8 directory, or 'smollm2' (the default).
            model_repository: the folder to write (other models in it are left alone).
            backend: the engine the models host: 'turbomind' or 'pytorch'.
            models: which models to write, separated by commas (ensemble brings its three steps).
            chat_template: a built-in template name (chatml, llama3, qwen2, internlm2, base) instead of the model's.
            launch: start tritonserver on the repository and serve until Ctrl-C.
            server_name: the address tritonserver listens on, with --launch.
            http_port: tritonserver's HTTP port, with --launch.
            grpc_port: tritonserver's gRPC port, with --launch.
            metrics_port: tritonserver's Prometheus metrics port, with --launch.
            postprocessing_instances: instances of the postprocessing model (detokenization).
            session_len: the longest context in tokens (default: the model's, at most 8192).
            max_batch_size: requests the engine runs at once.
            cache_max_entry_count: the fraction of free memory the KV cache may take.
            cache_block_seq_len: tokens per KV cache block.
            enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
            quant_policy: KV cache quantization: 0 none, 8 int8, 4 int4.
            model_format: hf, awq, w8a8 or gguf (default: from the model).
            dtype: auto, float32, bfloat16 or float16.
            num_threads: CPU threads for the engine (default: all cores).
            device: cpu or cuda (cuda puts the engine models in KIND_GPU instances).
        """
        from lmd.serve.triton import serve_triton
        fields = dict(session_len=session_len, max_batch_size=max_batch_size,
                      cache_max_entry_count=cache_max_entry_count, cache_block_seq_len=cache_block_seq_len,
                      enable_prefix_caching=enable_prefix_caching or None, quant_policy=quant_policy or None,
                      model_format=model_format, dtype=None if dtype == 'auto' else dtype,
                      num_threads=num_threads, device=device)
        rc = serve_triton(model_path, model_repository, backend=backend, models=models,
                            chat_template=chat_template, launch=launch, server_name=server_name,
                            http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                            postprocessing_instances=postprocessing_instances, **fields)
        if rc:
            sys.exit(rc)


    def triton_client(self, address: str, model: str | None = None, session_id: int | None = None,
                      system: str | None = None, max_tokens: int = 512, temperature: float | None = None,
                      top_p: float | None = None, top_k: int | None = None, repetition_penalty: float | None = None,
                      random_seed: int | None = None, stop_words=None):
        """Chat in the terminal with lmd's model on a Triton Inference Server (`lmd serve triton`), streamed
        over gRPC. The conversation is a session that keeps its KV cache between turns; /reset starts
        another, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer.

        Args:
            address: the server's gRPC endpoint, HOST:PORT (e.g. 127.0.0.1:8001), or triton://HOST:PORT/MODEL.
            model: 'ensemble' (the default) or 'lmd_model'.
            session_id: the first conversation's session id, 1 to 4294967295 (default: a random one).
            system: a system prompt for the conversation.
            max_tokens: the most tokens one answer may have.
            temperature: sampling temperature (default: greedy decoding); 0 is greedy.
            top_p: nucleus sampling mass.
            top_k: sample among the k likeliest tokens; 1 is greedy.
            repetition_penalty: >1 discourages repeating tokens.
            random_seed: makes sampling reproducible.
            stop_words: strings that end an answer, separated by commas.
        """
        from lmd.serve.triton_client import run_triton_client
        run_triton_client(address, model=model, session_id=session_id, system=system, max_tokens=max_tokens,
                          temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                          random_seed=random_seed, stop_words=stop_words)

class CLI:
    """lmd: LLM inference and serving. Subcommands: chat, convert, lite, serve. Add --help to any of them."""

    lite = Lite()
    serve = Serve()

    def chat(self, model_path: str | None = None, backend: str = 'pytorch', chat_template: str | None = None,
             system: str | None = None, session_len: int | None = None, cache_max_entry_count: float | None = None,
             enable_prefix_caching: bool = False, dtype: str = 'auto', quant_policy: int = 0,
             num_threads: int | None = None, max_new_tokens: int = 1024, do_sample: bool = False, temperature: float = 0.8, top_p: float = 1.0,
             top_k: int = 50, repetition_penalty: float = 1.0, random_seed: int | None = None):
        """Chat with a model in the terminal; answers stream as they are generated.

        Type /reset to start a new conversation and /exit (or Ctrl-D) to leave.

        Args:
            model_path: an HF model directory, a .gguf file, or 'smollm2' (the default, embedded model).
            backend: 'pytorch' or 'turbomind'.
            chat_template: a built-in template name (chatml, llama3, qwen2, internlm2, base) to use
                instead of the model's own.
            system: a system prompt for the conversation.
            session_len: the longest conversation in tokens (default: the model's context, at most 8192).
            cache_max_entry_count: the fraction of free memory the KV cache may take.
            enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
            dtype: auto, float32, bfloat16 or float16.
            quant_policy: KV cache quantization (turbomind): 0 none, 8 int8, 4 int4.
            num_threads: CPU threads for the engine (default: all cores).
            max_new_tokens: the most tokens one answer may have.
            do_sample: sample instead of greedy decoding.
            temperature: sampling temperature (with --do-sample).
            top_p: nucleus sampling mass (with --do-sample).
            top_k: sample among the k likeliest tokens (with --do-sample).
            repetition_penalty: >1 discourages repeating tokens.
            random_seed: makes sampling reproducible.
        """
        from .chat import run_chat
        from .messages import ChatTemplateConfig, GenerationConfig
        config = _engine_config(backend, session_len=session_len, cache_max_entry_count=cache_max_entry_count,
                                enable_prefix_caching=enable_prefix_caching, dtype=dtype, num_threads=num_threads,
                                quant_policy=quant_policy)
        gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                               top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                               random_seed=random_seed)
        template = ChatTemplateConfig(model_name=chat_template) if chat_template else None
        run_chat(model_path, backend, config, gen, template, system)

    def convert(self, model_path: str, out_dir: str, backend: str | None = None, dtype: str = 'auto',
                overwrite: bool = False):
        """Convert a model into a directory an engine loads without its source.

        Without --backend (or with --backend pytorch): a .gguf file into an HF-style directory,
        model.safetensors (float32), config.json, tokenizer.json and tokenizer_config.json with the
        chat template; it loads in lmd and in transformers.

        With --backend turbomind: a .gguf file or an HF model directory (float, AWQ or W8A8) into
        TurboMind's own layout: turbomind/model.safetensors (q/k/v and gate/up fused, quantized
        matmuls packed as the kernels read them; a GGUF's Q4_0/Q4_1 stay 4-bit), turbomind/config.json
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


def run_fire(component, argv: list[str] | None, name: str) -> int:
    """Run a fire command line; a user's mistake prints one ``lmd: error:`` line and returns 2."""
    import fire
    os.environ.setdefault('PAGER', 'cat')  # fire pages --help through less on a terminal otherwise
    try:
        fire.Fire(component, command=argv, name=name)
    except fire.core.FireExit as e:
        return e.code
    except (LmdError, ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f'lmd: error: {e}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_fire(CLI, argv, 'lmd')


if __name__ == '__main__':
    sys.exit(main())
