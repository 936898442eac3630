"""The kernels' thread pool (lib/kernels/csrc/cpu/thread_pool.cc): every piece of every region runs
exactly once, on a thread index below the team asked for, through many short regions, team sizes
that change between them, callers on several threads at once (one runs on the pool, the others
inline), and a busy process beside it; a kernel gives the same bits whatever ran it.
"""
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.dlpack import to_dlpack as dl

from lmd import kernels


def test_every_piece_runs_once_through_many_short_regions():
    for threads in (2, 3, 2, 1, 4, 2):  # the team grows, shrinks and grows again between regions
        for pieces in (1, 2, 3, 7, 64):
            assert kernels._kernels.thread_pool_check(threads, 500, pieces) == 0, (threads, pieces)
    stats = kernels._kernels.thread_pool_stats()
    assert stats['workers'] >= 3 and stats['regions'] > 0


def test_callers_on_several_threads_at_once():
    errors = []

    def call(threads: int) -> None:
        for _ in range(20):
            errors.append(kernels._kernels.thread_pool_check(threads, 200, 16))

    callers = [threading.Thread(target=call, args=(t,)) for t in (2, 3, 2, 4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert errors and not any(errors)


def test_a_busy_core_changes_no_piece_and_no_bit():
    torch.manual_seed(0)
    x = torch.randn(3, 256)
    w = torch.randn(1000, 256)
    y_quiet = torch.empty(3, 1000)
    kernels.ops.linear(dl(x), dl(w), None, dl(y_quiet))
    busy = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    old = kernels.ops.num_threads()
    try:
        kernels.ops.set_num_threads(2)
        for _ in range(200):  # long enough for stalls and the team cut and regrown
            y = torch.empty(3, 1000)
            kernels.ops.linear(dl(x), dl(w), None, dl(y))
            assert torch.equal(y, y_quiet)
        assert kernels._kernels.thread_pool_check(2, 2000, 8) == 0
    finally:
        kernels.ops.set_num_threads(old)
        busy.kill()
        busy.wait()


@pytest.mark.skipif(not hasattr(os, 'fork'), reason='no fork on this platform')
def test_a_forked_child_runs_its_own_pool():
    code = ('from lmd import kernels; import os\n'
            'pid = os.fork()\n'
            'if pid == 0:\n'
            '    os._exit(kernels._kernels.thread_pool_check(2, 200, 8))\n'
            'print(os.waitpid(pid, 0)[1])\n')
    parent = ('from lmd import kernels\n'  # the parent's workers started before the fork
              'assert kernels._kernels.thread_pool_check(2, 10, 8) == 0\n' + code)
    out = subprocess.run([sys.executable, '-c', parent], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '0'
