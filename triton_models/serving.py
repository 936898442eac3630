"""The Python-backend models of lmd's Triton repository.

Each ``<model>/1/model.py`` of a repository written by ``lmd serve triton`` imports
its ``TritonPythonModel`` from here. This module runs inside Triton's Python
backend stub, where ``triton_python_backend_utils`` is importable.

``EngineModel`` and ``LmdModel`` host one AsyncEngine for every request to the
model. Its event loop runs in a thread of its own: ``execute`` only checks a
request's inputs and hands it to the loop, which streams responses through the
request's response sender as the engine produces them (the models are
decoupled). A request whose client has gone away is cancelled there, which
aborts it in the engine and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import subprocess
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from lmd.messages import Response

from . import common
from .common import InputError

logger = logging.getLogger('lmd.triton')

# How often a generating request asks Triton whether its client is still there (each ask is a call into
# the server, which on a loaded CPU takes time from the engine).
CANCEL_POLL_SECONDS = 0.5
# How often the engine's gauges are refreshed on Triton's metrics endpoint.
STATS_SECONDS = 0.5
STATS_GAUGES = {
    'lmd_num_requests_running': 'Requests the engine is running',
    'lmd_num_requests_waiting': 'Requests waiting for the engine',
    'lmd_kv_cache_usage_perc': 'Fraction of KV cache blocks held by requests (1 = full)',
    'lmd_prefix_cache_hit_tokens': 'Prompt tokens served from the prefix cache since the start',
}


def _get(request):
    def get(name: str):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()
    return get


def _text_tensor(name: str, values: list[str]) -> 'pb_utils.Tensor':
    return pb_utils.Tensor(name, np.array([v.encode() for v in values], dtype=np.object_))


def _int_tensor(name: str, values) -> 'pb_utils.Tensor':
    return pb_utils.Tensor(name, np.asarray(values, dtype=np.int32).reshape(-1))


def _error(message: str, code=None) -> 'pb_utils.InferenceResponse':
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


# ---- preprocessing / postprocessing: stateless, one response per request ----------------------

class PreprocessingModel:
    """``prompt`` (+ ``sequence_start``) -> ``input_ids``, ``input_length``: chat template and tokenizer."""

    def initialize(self, args):
        params = common.parameters(json.loads(args['model_config']))
        self.tokenizer, self.template = common.load_text_side(params)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                values = common.read_inputs(_get(request), {'prompt': 'text', 'sequence_start': 'bool'},
                                            required=('prompt',))
                ids = common.prompt_ids(self.tokenizer, self.template, values['prompt'],
                                        values.get('sequence_start', True))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    _int_tensor('input_ids', ids), _int_tensor('input_length', [len(ids)])]))
            except (InputError, ValueError) as e:
                responses.append(_error(str(e)))
        return responses


class PostprocessingModel:
    """``output_ids`` (all generated so far), ``prev_length``, ``finish_reason`` -> ``text`` (the new text)."""

    def initialize(self, args):
        params = common.parameters(json.loads(args['model_config']))
        self.tokenizer, _ = common.load_text_side(params)
        self.engine_model = params.get('engine_model') or 'engine'
        self.asked: dict[int, float] = {}  # engine request id -> when we last asked whether it was cancelled

    def execute(self, requests):
        responses = []
        spec = {'output_ids': 'ids', 'prev_length': 'int', 'finish_reason': 'text', 'stop_words': 'texts',
                'request_id': 'uint'}
        for request in requests:
            try:
                values = common.read_inputs(_get(request), spec, required=('output_ids', 'prev_length'))
            except (InputError, ValueError) as e:
                responses.append(_error(str(e)))
                continue
            reason, rid = values.get('finish_reason', ''), values.get('request_id')
            if self._due(rid, last=bool(reason)) and request.is_cancelled():  # the client went away
                self._cancel_in_engine(rid)
                responses.append(_error('the request was cancelled', pb_utils.TritonError.CANCELLED))
                continue
            try:
                text = common.text_increment(self.tokenizer, values['output_ids'], values['prev_length'],
                                             final=bool(reason), stop_words=values.get('stop_words') or ())
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    _text_tensor('text', [text]), _text_tensor('finish_reason', [reason])]))
            except (InputError, ValueError) as e:
                responses.append(_error(str(e)))
        return responses

    def _due(self, rid: int | None, last: bool) -> bool:
        """Whether to ask Triton if engine request ``rid``'s stream was cancelled: each ask is a round
        trip to the server, so a stream is asked at most every CANCEL_POLL_SECONDS (and on its first
        and ``last`` response)."""
        if rid is None:
            return True
        if last:
            self.asked.pop(rid, None)
            return True
        now = time.monotonic()
        asked = self.asked.get(rid)
        if asked is not None and now - asked < CANCEL_POLL_SECONDS:
            return False
        if len(self.asked) > 4096:  # streams that ended without a last response (their client went away)
            self.asked = {k: t for k, t in self.asked.items() if now - t < 60 * CANCEL_POLL_SECONDS}
        self.asked[rid] = now
        return True

    def _cancel_in_engine(self, rid: int | None) -> None:
        if rid is None:
            return
        cancel = pb_utils.InferenceRequest(model_name=self.engine_model, requested_output_names=[],
                                           inputs=[pb_utils.Tensor('cancel', np.array([rid], dtype=np.uint64))])
        for response in cancel.exec(decoupled=True):
            if response.has_error():
                logger.warning('cancelling request %s in %s: %s', rid, self.engine_model,
                               response.error().message())


# ---- models that host an engine -----------------------------------------------------------------

class _EngineHost:
    """One AsyncEngine and the event loop that drives it, shared by all requests to the model."""

    prompt_spec: dict[str, str]

    def initialize(self, args):
        from lmd.async_engine import AsyncEngine
        config = json.loads(args['model_config'])
        self.model_name = config.get('name', args.get('model_name', ''))
        settings = common.EngineSettings.from_parameters(common.parameters(config))
        self.engine = AsyncEngine(settings.model_path, backend=settings.backend,
                                  backend_config=settings.backend_config(),
                                  chat_template_config=settings.chat_template_config())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f'lmd-{self.model_name}', daemon=True)
        self.thread.start()
        self._exit_with_server()
        self.running: dict[int, concurrent.futures.Future] = {}  # request id -> its serving coroutine
        self.session_tails: dict[int, int] = {}  # kept session -> the last token the engine holds for it
        labels = {'model': self.model_name}
        prompt = pb_utils.MetricFamily(name='lmd_prompt_tokens_total', kind=pb_utils.MetricFamily.COUNTER,
                                       description='Prompt tokens of finished requests (kept session history '
                                                   'included)')
        cached = pb_utils.MetricFamily(name='lmd_cached_prompt_tokens_total', kind=pb_utils.MetricFamily.COUNTER,
                                       description='Prompt tokens whose KV came from the cache: a kept session '
                                                   'or the prefix cache')
        generated = pb_utils.MetricFamily(name='lmd_generation_tokens_total', kind=pb_utils.MetricFamily.COUNTER,
                                          description='Tokens generated')
        self.prompt_tokens = prompt.Metric(labels=labels)
        self.cached_tokens = cached.Metric(labels=labels)
        self.generated_tokens = generated.Metric(labels=labels)
        gauges = {name: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                  for name, text in STATS_GAUGES.items()}
        self._families = (prompt, cached, generated, *gauges.values())  # a metric lives as long as its family
        self.gauges = {name: family.Metric(labels=labels) for name, family in gauges.items()}
        self._shown: dict[str, float] = {}
        asyncio.run_coroutine_threadsafe(self._publish_stats(), self.loop)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                if self.cancel(request):
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                job = self.prepare(request)
            except (InputError, ValueError) as e:
                sender.send(_error(str(e)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            rid = job['session_id']
            if job['end_only']:
                self._end_session(sender, job)
                continue
            fut = asyncio.run_coroutine_threadsafe(self._serve(sender, job), self.loop)
            self.running.setdefault(rid, fut)  # a second turn of a busy session fails in the engine
            fut.add_done_callback(lambda f, rid=rid: self.running.pop(rid, None) if self.running.get(rid) is f
                                  else None)
        return None

    def cancel(self, request) -> bool:
        """Whether ``request`` asks to stop another (see EngineModel); it is then done."""
        return False

    def _end_session(self, sender, job: dict) -> None:
        """A request with nothing to say that ends its session: free the session (stopping a turn still
        running) and answer at once with an empty, finished response."""
        sid = job['session_id']
        fut = self.running.get(sid)
        if fut is not None:
            fut.cancel()
        self.session_tails.pop(sid, None)
        self.engine.end(sid)
        done = Response(text='', generate_token_len=0, input_token_len=0, finish_reason='stop', session_id=sid)
        sender.send(pb_utils.InferenceResponse(output_tensors=self.outputs(job, done, True)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def prepare(self, request) -> dict[str, Any]:
        """The request's inputs, checked: everything ``generate`` needs."""
        values = common.read_inputs(_get(request), {**self.prompt_spec, **common.SAMPLING_INPUTS,
                                                    **common.SESSION_INPUTS})
        sid, start, end = common.session_of(values)
        (name, _), = self.prompt_spec.items()
        given = values.get(name)
        end_only = not start and end and not given  # nothing to say: just end the session
        if not given and not end_only:
            raise InputError(f"input '{name}' is required" if given is None else f"input '{name}' is empty")
        if sid is None:
            sid = self.engine.next_session_id()
        return dict(values=values, gen=common.generation_config(values), session_id=sid,
                    sequence_start=start, sequence_end=end, end_only=end_only)

    def input_ids(self, job: dict) -> list[int]:
        raise NotImplementedError

    def outputs(self, job: dict, response, final: bool) -> list:
        raise NotImplementedError

    async def _serve(self, sender, job: dict) -> None:
        task = asyncio.current_task()
        watch = asyncio.ensure_future(self._watch(sender, task))
        try:
            await self._stream(sender, job)
        except asyncio.CancelledError:  # the client went away: generate() aborted the request
            self._send_final(sender, None)
        except (InputError, ValueError) as e:
            self._send_final(sender, _error(str(e)))
        except Exception as e:  # noqa: BLE001  the model keeps serving everyone else
            logger.exception('request failed')
            self._send_final(sender, _error(f'{type(e).__name__}: {e}', pb_utils.TritonError.INTERNAL))
        finally:
            watch.cancel()

    def _continue_session(self, job: dict, ids: list[int]) -> list[int]:
        """A next turn's ids start by closing the last answer (``<|im_end|>``...); when that answer
        stopped on that very token, the engine holds it already."""
        tail = self.session_tails.pop(job['session_id'], None)
        if not job['sequence_start'] and ids and ids[0] == tail and tail in self.engine.eos_token_ids:
            return ids[1:]
        return ids

    async def _stream(self, sender, job: dict) -> None:
        sid, keep = job['session_id'], not job['sequence_end']
        ids = self._continue_session(job, self.input_ids(job))
        held: list[int] | None = [] if keep else None  # what the engine appends to a kept session
        final_sent = False
        async for r in self.engine.generate(None, sid, job['gen'], input_ids=ids,
                                            sequence_start=job['sequence_start'],
                                            sequence_end=job['sequence_end'], engine_ids=held):
            final = r.finish_reason is not None
            if final:
                self.prompt_tokens.increment(r.input_token_len)
                self.cached_tokens.increment(r.num_cached_tokens)
                self.generated_tokens.increment(r.generate_token_len)
            response = pb_utils.InferenceResponse(output_tensors=self.outputs(job, r, final))
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            final_sent = final
        if not final_sent:
            self._send_final(sender, None)
        if held:
            self.session_tails[sid] = held[-1]

    @staticmethod
    def _exit_with_server() -> None:
        """A stub whose tritonserver died (or gave up waiting for requests at exit) would keep its engine
        threads, and a request they were generating, alive: a call to the server that never answers can
        hold the GIL, so no thread of this process can end it. A shell outside it does."""
        server, me = os.getppid(), os.getpid()
        script = (f'while kill -0 {server} 2>/dev/null && kill -0 {me} 2>/dev/null; do sleep 1; done; '
                  f'kill -9 {me} 2>/dev/null')
        subprocess.Popen(['/bin/sh', '-c', script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)

    async def _publish_stats(self) -> None:
        """The engine's gauges, refreshed for Triton's metrics endpoint."""
        while True:
            st = self.engine.stats()
            values = {'lmd_num_requests_running': st.num_running, 'lmd_num_requests_waiting': st.num_waiting,
                      'lmd_kv_cache_usage_perc': st.kv_usage,
                      'lmd_prefix_cache_hit_tokens': st.num_prefix_hit_tokens}
            for name, value in values.items():
                if self._shown.get(name) != value:  # each set is a call into the server
                    self.gauges[name].set(float(value))
                    self._shown[name] = value
            await asyncio.sleep(STATS_SECONDS)

    @staticmethod
    def _send_final(sender, response) -> None:
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001  the stream is gone already
            pass

    @staticmethod
    async def _watch(sender, task: asyncio.Task) -> None:
        while not task.done():
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            if sender.is_cancelled():
                task.cancel()
                return

    def finalize(self):
        for fut in list(self.running.values()):
            fut.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.engine.close()


class EngineModel(_EngineHost):
    """``input_ids`` (+ sampling and session inputs) -> streamed ``output_ids`` (all generated so far),
    ``prev_length`` (how many of them earlier responses carried), ``finish_reason``,
    ``prompt_tokens``, ``cached_tokens``, and the request's ``stop_words`` and ``request_id`` for
    postprocessing. A request with a ``cancel`` input stops the running request of that id."""

    prompt_spec = {'input_ids': 'ids'}

    def cancel(self, request) -> bool:
        t = pb_utils.get_input_tensor_by_name(request, 'cancel')
        if t is None:
            return False
        rid = common.read_inputs(lambda name: t.as_numpy(), {'cancel': 'uint'})['cancel']
        fut = self.running.get(rid)
        if fut is not None:
            fut.cancel()  # its coroutine is cancelled: generate() aborts it in the engine
        return True

    def prepare(self, request):
        job = super().prepare(request)
        job['output_ids'] = []
        return job

    def input_ids(self, job):
        return job['values']['input_ids']

    def outputs(self, job, r, final):
        ids = job['output_ids']
        prev = len(ids)
        ids.extend(r.token_ids)
        return [_int_tensor('output_ids', ids), _int_tensor('prev_length', [prev]),
                _text_tensor('finish_reason', [r.finish_reason or '']),
                _int_tensor('prompt_tokens', [r.input_token_len]), _int_tensor('cached_tokens', [r.num_cached_tokens]),
                _text_tensor('stop_words', job['values'].get('stop_words') or []),
                pb_utils.Tensor('request_id', np.array([job['session_id']], dtype=np.uint64))]


class LmdModel(_EngineHost):
    """The whole pipeline in one model: ``prompt`` (+ sampling and session inputs) -> streamed ``text``."""

    prompt_spec = {'prompt': 'text'}

    def input_ids(self, job):
        e = self.engine
        return common.prompt_ids(e.tokenizer, e.chat_template, job['values']['prompt'], job['sequence_start'])

    def outputs(self, job, r, final):
        return [_text_tensor('text', [r.text]), _text_tensor('finish_reason', [r.finish_reason or ''])]
