"""``pipeline()``: the synchronous front door over an AsyncEngine.

The AsyncEngine lives on an event loop in a background thread; calls from the
user's thread submit coroutines to it, so a pipeline also works inside Jupyter
or another running event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Iterator

from .async_engine import AsyncEngine, Session
from .messages import (ChatTemplateConfig, EngineConfig, GenerationConfig, PytorchEngineConfig, Response,
                       SpeculativeConfig, TurbomindEngineConfig)

if TYPE_CHECKING:
    import torch

Prompt = str | list[dict]


def _as_batch(prompts) -> tuple[list[Prompt], bool]:
    """(prompts as a list, whether the caller gave a single one)."""
    if isinstance(prompts, str):
        return [prompts], True
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts], True  # one OpenAI-style conversation
    if isinstance(prompts, (list, tuple)) and all(isinstance(p, (str, list)) for p in prompts):
        if not prompts:
            raise ValueError('prompts is empty')
        return list(prompts), False
    raise ValueError('prompts must be a string, a list of strings, or OpenAI-style message lists')


class Pipeline:

    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine
        self.tokenizer = async_engine.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name='lmd-pipeline-loop', daemon=True)
        self._thread.start()
        # close() when the pipeline is dropped or, still open, at interpreter exit: the loop thread
        # then ends and lets go of the engine while the interpreter still runs (a daemon thread
        # freeing the model's tensors during teardown is killed inside C++ frames, and aborts)
        self._finalizer = weakref.finalize(self, _shut_down, async_engine, self._loop, self._thread)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _gen_configs(self, gen_config, n_prompts: int) -> list[GenerationConfig]:
        if gen_config is None:
            return [GenerationConfig()] * n_prompts
        if isinstance(gen_config, GenerationConfig):
            return [gen_config] * n_prompts
        if len(gen_config) != n_prompts:
            raise ValueError(f'got {len(gen_config)} gen_configs for {n_prompts} prompts')
        return list(gen_config)

    def __call__(self, prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                 do_preprocess: bool = True,
                 adapter_name: str | None = None) -> Response | list[Response] | list[list[Response]]:
        """Answer every prompt; with ``n > 1`` each prompt gets a list of ``n`` Responses. ``adapter_name``:
        a LoRA adapter of the engine config's ``adapters`` (or ``load_adapter``) answers them."""
        batch, single = _as_batch(prompts)
        gens = self._gen_configs(gen_config, len(batch))

        async def one(i: int, prompt, gen: GenerationConfig):
            outs = [None] * gen.n
            async for r in self.async_engine.generate_n(prompt, gen, stream_response=False,
                                                        do_preprocess=do_preprocess, adapter_name=adapter_name):
                outs[r.index] = r
            for r in outs:
                r.index = i
            return outs if gen.n > 1 else outs[0]

        async def run_all():
            return await asyncio.gather(*(one(i, p, g) for i, (p, g) in enumerate(zip(batch, gens))))

        results = self._run(run_all())
        return results[0] if single else results

    def stream_infer(self, prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                     do_preprocess: bool = True, adapter_name: str | None = None) -> Iterator[Response]:
        """Yield Responses as tokens arrive; ``index`` names the prompt each belongs to."""
        batch, _ = _as_batch(prompts)
        gens = self._gen_configs(gen_config, len(batch))
        for g in gens:
            if g.n != 1:
                raise ValueError('stream_infer takes n=1; call the pipeline itself for n > 1')

        async def produce(put):
            async def one(i, prompt, gen):
                async for r in self.async_engine.generate(prompt, gen_config=gen, do_preprocess=do_preprocess,
                                                          index=i, adapter_name=adapter_name):
                    put(r)
            await asyncio.gather(*(one(i, p, g) for i, (p, g) in enumerate(zip(batch, gens))))

        return self._stream(produce)

    def _stream(self, produce) -> Iterator:
        """Run the coroutine ``produce(put)`` on the engine's loop and yield what it puts, here,
        as it comes. A consumer that stops early cancels it (which aborts its requests)."""
        q: queue.Queue = queue.Queue()
        done = object()

        async def run():
            try:
                await produce(q.put)
            except BaseException as e:
                q.put(e)
            finally:
                q.put(done)

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    # ---- scoring ---------------------------------------------------------------------------

    def get_logits(self, input_ids: list[int] | list[list[int]]) -> list[torch.Tensor]:
        """As LMDeploy's: a list with each sequence's teacher-forced float32 logits [len, vocab_size]
        (``AsyncEngine.get_logits``)."""
        return self._run(self.async_engine.get_logits(input_ids))

    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """As LMDeploy's: a list with each sequence's mean negative log-likelihood in nats (the
        cross-entropy loss; ``math.exp`` of it is the perplexity), ``AsyncEngine.get_ppl``."""
        return self._run(self.async_engine.get_ppl(input_ids))

    # ---- embeddings ------------------------------------------------------------------------

    def embed(self, inputs, dimensions: int | None = None) -> list[list[float]]:
        """As vLLM's ``LLM.embed``: one embedding per input (a text, a list of texts, a list of token
        ids or a list of such lists), pooled as the model's directory declares (``AsyncEngine.embed``)."""
        return [e.tolist() for e in self._run(self.async_engine.embed(inputs, dimensions))]

    # ---- interactive sessions -------------------------------------------------------------

    def new_session(self, system: str | None = None) -> Session:
        return self.async_engine.new_session(system)

    def chat(self, message: str, session: Session | None = None,
             gen_config: GenerationConfig | None = None) -> tuple[Response, Session]:
        """One turn of a conversation whose KV cache stays in the engine; returns (answer, session)."""
        session = session or self.new_session()

        async def run():
            text, last = [], None
            async for r in self.async_engine.chat(session, message, gen_config):
                text.append(r.text)
                last = r
            last.text = ''.join(text)
            return last

        return self._run(run()), session

    def stream_chat(self, message: str, session: Session,
                    gen_config: GenerationConfig | None = None) -> Iterator[Response]:
        async def produce(put):
            async for r in self.async_engine.chat(session, message, gen_config):
                put(r)

        return self._stream(produce)

    def end_session(self, session: Session) -> None:
        self.async_engine.end_session(session)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shut_down(async_engine: AsyncEngine, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Close the engine, stop the loop and wait for its thread (``Pipeline.close``; once)."""
    async_engine.close()
    loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()


def pipeline(model_path: str | None = None,
             backend_config: PytorchEngineConfig | TurbomindEngineConfig | EngineConfig | None = None,
             chat_template_config: ChatTemplateConfig | None = None,
             backend: str = 'auto', speculative_config: SpeculativeConfig | None = None, **kwargs) -> Pipeline:
    """Load a model and return a Pipeline; ``model_path`` None or 'smollm2' is the embedded default.

    ``model_path`` is an HF directory, a .gguf file, or a hub id that is cached locally.
    ``backend`` 'auto' (as LMDeploy) runs TurboMind where it runs the model, its format and
    device, else the PyTorch engine; a ``TurbomindEngineConfig`` or ``PytorchEngineConfig``
    given without a backend chooses its own engine (``lmd.backend``). ``speculative_config``
    (LMDeploy's argument) turns on speculative decoding: it becomes the engine config's
    ``speculative_config``.
    """
    if kwargs:
        raise TypeError(f'pipeline() got unexpected arguments: {", ".join(sorted(kwargs))}')
    if speculative_config is not None:
        if backend_config is None:
            backend_config = {'pytorch': PytorchEngineConfig, 'turbomind': TurbomindEngineConfig}.get(
                backend, EngineConfig)()
        backend_config = dataclasses.replace(backend_config, speculative_config=speculative_config)
    return Pipeline(AsyncEngine(model_path, backend=backend, backend_config=backend_config,
                                chat_template_config=chat_template_config))
