"""Scheduler with fake sequences and no model: budgets, chunked prefill, batch size, preemption."""
from lmd.engine import SamplingParams
from lmd.pytorch_backend.block_manager import BlockManager
from lmd.pytorch_backend.scheduler import Scheduler
from lmd.pytorch_backend.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(sid, n, start=None):
    start = sid * 1000 if start is None else start
    return Sequence(sid, list(range(start, start + n)), SamplingParams(), None, None)


def make(num_blocks=64, max_batch_size=8, budget=16, prefix=False):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(bm, max_batch_size, budget), bm


def step(sched, max_new=3, finished=None, log=None):
    """One fake step: schedule, 'run', append a token to each sequence that caught up, finish at max_new."""
    out = sched.schedule()
    if log is not None:
        log.append(out)
    sched.update(out)
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_generated_tokens >= max_new:
                sched.finish(seq)
                if finished is not None:
                    finished.append(seq)
    all_seqs = list(sched.running) + list(sched.waiting) + list(sched.idle.values())
    sched.block_manager.check_invariants(all_seqs)
    return out


def run_all(sched, max_new=3, max_steps=1000):
    finished, log = [], []
    for _ in range(max_steps):
        if not sched.has_work:
            break
        step(sched, max_new, finished, log)
    assert not sched.has_work
    return finished, log


def test_chunked_prefill_within_token_budget():
    sched, bm = make(budget=16)
    seq = make_seq(1, 40)
    sched.add(seq)
    finished, log = run_all(sched, max_new=3)
    assert [o.num_scheduled_tokens for o in log] == [(16,), (16,), (8,), (1,), (1,)]
    assert finished == [seq] and seq.num_generated_tokens == 3
    assert bm.num_used_blocks == 0


def test_running_decodes_go_first_and_budget_is_shared():
    sched, _ = make(budget=16)
    a, b, c = make_seq(1, 6), make_seq(2, 30), make_seq(3, 5)
    for s in (a, b, c):
        sched.add(s)
    log = []
    step(sched, 100, log=log)
    assert log[0].seqs == (a, b) and log[0].num_scheduled_tokens == (6, 10)  # FIFO, b chunked, c waits
    step(sched, 100, log=log)
    assert log[1].seqs == (a, b) and log[1].num_scheduled_tokens == (1, 15)  # a decodes first
    step(sched, 100, log=log)
    assert log[2].seqs == (a, b, c) and log[2].num_scheduled_tokens == (1, 5, 5)
    for out in log:
        assert out.total_num_scheduled_tokens <= 16


def test_max_batch_size():
    sched, _ = make(max_batch_size=2, budget=64)
    seqs = [make_seq(i, 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    finished, log = run_all(sched, max_new=2)
    assert all(len(o.seqs) <= 2 for o in log)
    assert [s.session_id for s in finished] == [0, 1, 2, 3, 4]
    assert log[0].seqs == tuple(seqs[:2])


def test_preemption_frees_the_newest_and_recomputes_it():
    # 6 blocks of 4: three 8-token prompts fit (2 blocks each) but cannot all grow past 8 tokens
    sched, bm = make(num_blocks=6, budget=64)
    seqs = [make_seq(i, 8) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step(sched, 10)                    # prefill all three: 6 blocks in use
    assert bm.num_free_blocks == 0 and all(s.status is SequenceStatus.RUNNING for s in seqs)
    out = step(sched, 10)              # token 9 needs a 3rd block each -> preempt the newest
    assert sched.num_preemptions >= 1
    newest = seqs[2]
    assert newest.status is SequenceStatus.WAITING and newest.num_computed_tokens == 0
    assert newest.block_ids == [] and sched.waiting[0] is newest and newest not in out.seqs
    assert newest.num_generated_tokens == 1  # its generated token stays in its context
    finished, _ = run_all(sched, max_new=10)
    assert len(finished) == 3
    assert all(s.num_generated_tokens == 10 for s in seqs)
    assert bm.num_used_blocks == 0


def test_preempted_sequences_keep_fifo_order():
    sched, _ = make(num_blocks=8, budget=64)
    seqs = [make_seq(i, 8) for i in range(4)]      # 2 blocks each: the cache is full after prefill
    for s in seqs:
        sched.add(s)
    step(sched, 10)
    step(sched, 10)                                # everyone needs a 3rd block: the two newest go
    assert [s.session_id for s in sched.waiting] == [2, 3]
    assert sched.num_preemptions == 2
    run_all(sched, max_new=10)


def test_prompt_larger_than_the_cache_fails_cleanly():
    sched, bm = make(num_blocks=4, budget=64)
    big, ok = make_seq(1, 17), make_seq(2, 5)
    sched.add(big)
    sched.add(ok)
    out = sched.schedule()
    assert [s for s, _ in out.failed] == [big] and out.seqs == (ok,)
    assert big.status is SequenceStatus.FINISHED and bm.num_used_blocks == 2


def test_prefix_match_on_admission():
    sched, bm = make(num_blocks=32, budget=64, prefix=True)
    a = make_seq(1, 20, start=0)
    sched.add(a)
    run_all(sched, max_new=1)
    b = make_seq(2, 22, start=0)                   # shares a's first 20 tokens: 5 full blocks
    sched.add(b)
    out = step(sched, 5)
    assert out.num_scheduled_tokens == (2,) and b.num_cached_tokens == 20
    assert bm.num_prefix_hit_tokens == 20
    c = make_seq(3, 20, start=0)                   # all cached: the last block is recomputed
    sched.add(c)
    out = step(sched, 5)
    assert out.num_scheduled_tokens[-1] == 4 and c.num_cached_tokens == 16


def test_idle_session_blocks_are_released_before_preempting():
    sched, bm = make(num_blocks=6, budget=64)
    s = make_seq(1, 11)
    sched.add(s)
    step(sched, 100)
    sched.finish(s, keep=True)                     # an interactive session between turns: 3 blocks kept
    assert s.status is SequenceStatus.IDLE and len(s.block_ids) == 3
    a = make_seq(2, 12)
    sched.add(a)
    step(sched, 100)                               # needs 3 + 1 for growth: the idle session gives way
    step(sched, 100)
    assert s.block_ids == [] and s.num_computed_tokens == 0 and sched.num_preemptions == 0
    sched.finish(a)
    s.token_ids.extend([5, 6])
    sched.resume(s)                                # its next turn recomputes everything
    out = step(sched, 100)
    assert out.num_scheduled_tokens == (s.num_tokens - 1,)  # the appended decode token is not yet computed


def test_kept_session_continues_from_its_cache():
    sched, bm = make(num_blocks=16, budget=64)
    s = make_seq(1, 10)
    sched.add(s)
    step(sched, 100)
    step(sched, 100)
    sched.finish(s, keep=True)
    computed = s.num_computed_tokens
    assert computed == 11                          # prompt + 1st generated; the 2nd is not computed yet
    s.start_turn([1, 2, 3], SamplingParams(), None, None, True)
    sched.resume(s)
    out = step(sched, 100)
    assert out.num_scheduled_tokens == (4,)        # the 2nd generated token and the 3 new ones
    assert s.num_cached_tokens == computed
