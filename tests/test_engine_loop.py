"""Requests added with an event loop (``Engine.add_request(..., loop=)``, what AsyncEngine does):
their callbacks run on the loop's thread, a step's outputs reach the loop with one wake (no
``call_soon_threadsafe`` per output; TurboMind: no reader thread, the loop watches the engine's
eventfd), and what they get is what a thread callback gets: the same tokens, in order, one final
output, aborts on close. Both engines, tiny random models."""
from __future__ import annotations

import asyncio
import random
import selectors
import threading

import pytest

from lmd.engine import EngineRequest, SamplingParams
from test_pytorch_engine import Collector, generate, rand_prompt, tiny_engine, tiny_models  # noqa: F401
from test_turbomind_engine import tm_engine

ENGINES = {'pytorch': tiny_engine, 'turbomind': tm_engine}
READER = 'lmd-turbomind-outputs'


class CountingSelector(selectors.DefaultSelector):
    """Counts the loop's wakeups: select calls that returned with something ready."""

    def __init__(self):
        super().__init__()
        self.wakeups = 0

    def select(self, timeout=None):
        events = super().select(timeout)
        self.wakeups += bool(events)
        return events


class CountingLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.selector = CountingSelector()
        super().__init__(self.selector)
        self.threadsafe_calls = 0
        self.threads: set[int] = set()  # the threads callbacks ran on

    def call_soon_threadsafe(self, *args, **kwargs):
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == READER]


async def stream(engine, prompts, sp, first_sid=0, during=None):
    """Every prompt at once on the running loop; (token lists, final outputs). ``during(i)`` runs
    after each output (on the loop's thread)."""
    loop = asyncio.get_running_loop()
    queues = []
    for i, p in enumerate(prompts):
        q: asyncio.Queue = asyncio.Queue()

        def put(out, q=q):
            if isinstance(loop, CountingLoop):
                loop.threads.add(threading.get_ident())
            q.put_nowait(out)
        engine.add_request(EngineRequest(first_sid + i, tuple(p), sp), put, loop=loop)
        queues.append(q)

    async def collect(q):
        tokens, final = [], None
        while final is None:
            out = await q.get()
            tokens.extend(out.token_ids)
            if out.finish_reason is not None:
                final = out
            if during is not None:
                during(out)
        await asyncio.sleep(0.05)
        assert q.empty(), 'an output after the final one'
        return tokens, final

    results = await asyncio.gather(*(collect(q) for q in queues))
    return [r[0] for r in results], [r[1] for r in results]


def run_on(loop, coro):
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.mark.parametrize('backend', list(ENGINES))
def test_one_wakeup_per_step_same_outputs(tiny_models, backend):
    rng = random.Random(11)
    prompts = [rand_prompt(rng, 6) for _ in range(4)]
    n = 16
    sp = SamplingParams(max_new_tokens=n)
    with ENGINES[backend](tiny_models) as engine:
        loop = CountingLoop()
        got, finals = run_on(loop, stream(engine, prompts, sp, first_sid=100))
        expected, _ = generate(engine, prompts, sp)  # thread callbacks: the reference
    assert got == expected
    assert all(f.finish_reason == 'length' for f in finals)
    assert loop.threads == {threading.main_thread().ident}  # every callback on the loop's thread
    # one prefill step for all four, then n - 1 decode steps; 4 * n outputs in all
    steps = n
    assert loop.selector.wakeups <= steps + 2, loop.selector.wakeups
    if backend == 'turbomind':
        assert loop.threadsafe_calls == 0  # the loop reads the engine's eventfd itself
    else:
        assert 1 <= loop.threadsafe_calls <= steps + 2, loop.threadsafe_calls  # one handoff a step


def test_turbomind_no_reader_thread_while_a_loop_watches(tiny_models):
    rng = random.Random(12)
    prompts = [rand_prompt(rng, 9) for _ in range(2)]
    sp = SamplingParams(max_new_tokens=8)
    with tm_engine(tiny_models) as engine:
        assert not reader_threads()  # none before a request needs one
        seen = []
        got, finals = run_on(CountingLoop(), stream(engine, prompts, sp,
                                                    during=lambda out: seen.append(len(reader_threads()))))
        assert seen and not any(seen) and not reader_threads()
        assert engine.is_alive()
        # thread callbacks get a reader; it leaves once it serves no one and a loop watches
        col = Collector()
        col.on_output = lambda out: seen.append(-len(reader_threads()))
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(50 + i, tuple(p), sp), col.callback)
        col.wait([50, 51])
        assert [col.tokens(50 + i) for i in range(2)] == got and min(seen) == -1
        seen.clear()
        third, _ = run_on(CountingLoop(), stream(engine, prompts, sp, first_sid=60,
                                                 during=lambda out: seen.append(len(reader_threads()))))
        assert third == got and seen[-1] == 0 and not reader_threads(), seen
    assert all(len(t) == 8 for t in got) and all(f.finish_reason == 'length' for f in finals)


@pytest.mark.parametrize('backend', list(ENGINES))
def test_loops_one_after_another_and_mixed_with_threads(tiny_models, backend):
    """asyncio.run twice on one engine (the watching loop moves), and thread callbacks in flight
    beside loop requests: every request gets its own tokens in order."""
    rng = random.Random(13)
    prompts = [rand_prompt(rng, rng.randrange(3, 30)) for _ in range(6)]
    sp = SamplingParams(max_new_tokens=12)
    with ENGINES[backend](tiny_models, max_batch_size=8) as engine:
        expected, _ = generate(engine, prompts, sp)
        first, _ = asyncio.run(stream(engine, prompts[:3], sp, first_sid=10))
        assert first == expected[:3]

        col = Collector()

        async def mixed():
            for i, p in enumerate(prompts[3:]):  # thread callbacks, added from the loop's thread
                engine.add_request(EngineRequest(40 + i, tuple(p), sp), col.callback)
            return await stream(engine, prompts[:3], sp, first_sid=20)

        second, _ = run_on(CountingLoop(), mixed())
        col.wait([40, 41, 42])
        assert second == expected[:3]
        assert [col.tokens(40 + i) for i in range(3)] == expected[3:]


@pytest.mark.parametrize('backend', list(ENGINES))
def test_close_aborts_loop_requests(tiny_models, backend):
    rng = random.Random(14)
    prompts = [rand_prompt(rng, 5) for _ in range(3)]
    sp = SamplingParams(max_new_tokens=400)
    engine = ENGINES[backend](tiny_models, session_len=512)

    async def main():
        closer = None

        def on_out(out):
            nonlocal closer
            if closer is None:  # close from another thread while the loop waits for outputs
                closer = threading.Thread(target=engine.close)
                closer.start()
        got, finals = await stream(engine, prompts, sp, during=on_out)
        closer.join()
        return got, finals

    got, finals = asyncio.run(main())
    assert [f.finish_reason for f in finals] == ['abort'] * 3
    assert all(len(t) < 400 for t in got)
    assert not engine.is_alive()
    assert not reader_threads()
