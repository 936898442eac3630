"""Starting the parallel ranks: ``mp`` (local processes) or ``ray`` (actors placed on a Ray cluster).

``PytorchEngineConfig.distributed_executor_backend`` chooses, as in LMDeploy and vLLM. Either way the
engine's process is rank 0 and the others run ``distributed.run_rank``; they differ only in where those
run and how the driver learns that one ended:

- ``mp``: ``tp * pp - 1`` processes started by ``multiprocessing``'s spawn (a script that starts an engine
  with tp > 1 keeps its top level under ``if __name__ == '__main__':``, as for any spawned process);
- ``ray``: one actor per rank in a placement group of one CPU bundle per rank (bundle 0 stands for the
  driver's rank), spread over the cluster's nodes; the cluster is ``ray_address``, else ``RAY_ADDRESS``,
  else a local one that ``ray.init`` starts. The ranks meet at the driver node's address.
"""
from __future__ import annotations

import logging
import multiprocessing
import os

from .distributed import RankGroup, host_address, make_groups, make_store

logger = logging.getLogger('lmd.pytorch_backend')


def start_ranks(model_dir: str, config, num_blocks: int, session_len: int, num_threads: int):
    """(the executor of ranks 1.., rank 0's ``ModelRunner`` over its shard, the checkpoint's format), once
    every rank has built its own; the ranks are let go again if any fails."""
    from .distributed import build_rank_model
    executor = RankExecutor(model_dir, config, num_blocks, session_len, num_threads)
    try:
        runner, fmt = build_rank_model(model_dir, config, 0, executor.groups, num_blocks, session_len,
                                       ranks=executor.ranks)
        executor.ready()
    except BaseException:
        executor.close()
        raise
    return executor, runner, fmt


class RankExecutor:
    """Ranks 1 .. tp * pp - 1 of an engine, started; ``groups`` the driver's process groups
    (``distributed.make_groups``), ``ranks`` its line to the other ranks."""

    def __init__(self, model_dir: str, config, num_blocks: int, session_len: int, num_threads: int):
        self.size = config.tp * config.pp
        self.backend = config.distributed_executor_backend or 'mp'
        host = '127.0.0.1'
        if self.backend == 'ray':
            self._ray_connect(config.ray_address)
            host = host_address('')  # this node's address, as the cluster sees it
        store = make_store(host, 0, is_master=True)
        args = (model_dir, config, host, store.port, num_blocks, session_len, num_threads)  # run_rank's, after the rank
        self._procs, self._actors = [], []
        if self.backend == 'mp':
            self._start_processes(args)
        else:
            self._start_actors(args)
        self.store = store
        self.groups = make_groups(store, host, 0, config.tp, config.pp)  # waits for every rank to join
        self.ranks = RankGroup(self.groups[0], self.status)

    def ready(self) -> None:
        """Wait until every rank has built its shard (after the driver built its own)."""
        try:
            self.ranks.group.barrier().wait()
        except RuntimeError as e:
            raise self.ranks.failure(e) from e

    def status(self) -> dict[int, str | None]:
        """rank -> None while it runs, else how it ended."""
        if self.backend == 'mp':
            return {r: None if p.is_alive() else f'exited with code {p.exitcode}'
                    for r, p in enumerate(self._procs, start=1)}
        import ray
        done, _ = ray.wait(list(self._runs), timeout=0, num_returns=len(self._runs))
        status = {r: None for r in range(1, self.size)}
        for ref in done:
            r = self._runs[ref]
            try:
                ray.get(ref)
                status[r] = 'returned'
            except Exception as e:  # ray.exceptions.RayActorError when its process died
                status[r] = f'died ({type(e).__name__})'
        return status

    def close(self) -> None:
        """Tell the ranks to stop (if they still listen), then make sure they have."""
        try:
            self.ranks.send(None)
        except Exception:
            pass  # a rank is gone already: the others' group is broken and they end on their own
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if self._actors:
            import ray
            for actor in self._actors:
                ray.kill(actor)
            ray.util.remove_placement_group(self._placement_group)

    # -- mp ---------------------------------------------------------------------------------------------

    def _start_processes(self, args) -> None:
        from .distributed import run_rank
        ctx = multiprocessing.get_context('spawn')
        for rank in range(1, self.size):
            p = ctx.Process(target=run_rank, name=f'lmd-rank-{rank}', daemon=True, args=(rank, *args))
            p.start()
            self._procs.append(p)

    # -- ray --------------------------------------------------------------------------------------------

    @staticmethod
    def _ray_connect(address: str | None) -> None:
        try:
            import ray
        except ImportError as e:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install ray") from e
        if not ray.is_initialized():
            address = address or os.environ.get('RAY_ADDRESS')
            # the workers import lmd from the Python environment they run in, as the driver does
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)

    def _start_actors(self, args) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .distributed import run_rank
        self._placement_group = pg = placement_group([{'CPU': 1}] * self.size, strategy='SPREAD')
        ray.get(pg.ready(), timeout=120)
        rank_actor = ray.remote(num_cpus=1)(_RankActor)
        self._runs = {}
        for rank in range(1, self.size):
            actor = rank_actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)).remote()
            self._actors.append(actor)
            self._runs[actor.run.remote(run_rank, rank, *args)] = rank


class _RankActor:
    """A Ray actor that runs one rank until the driver lets it go."""

    def run(self, run_rank, *args) -> None:
        run_rank(*args)

