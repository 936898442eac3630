"""Tensor and pipeline parallelism across processes: the ranks' process groups, the driver's line to the
other ranks, and the loop a rank runs.

The engine's process is rank 0, the driver: it schedules, samples and talks to callers, as with one
rank. The other ``tp * pp - 1`` ranks are processes of their own (``executor.py`` starts them: local
processes, or Ray actors on a cluster's nodes), each holding its shard of the model
(``lmd.weights.tensor_parallel``) and a KV cache of its KV heads with the same blocks as the driver's.
Each call of the driver's ``ModelRunner`` that runs the model (a step, a scoring pass) is first sent to
them as it is (``RankGroup.send``: the step's ``StepPlan``, plain lists: the scheduler's output, not
tensors), and every rank then runs it; the model's collectives (``TensorParallel``: an all-reduce
after attention and after the MLP, the embedding's all-reduce, the logits' all-gather) meet in the same
order on every rank. With ``pp`` stages (``pipeline_parallel.py``) rank g is tensor-parallel rank g % tp
of stage g // tp: it holds its stage's layers only, its tensor-parallel collectives run in its stage's
group, and the stages hand their micro-batches on point to point.

Collectives run on one process group made without ``torch.distributed.init_process_group`` (gloo on
CPUs), so an engine's group is its own: several engines (and other torch.distributed users) live in
one process. A rank that dies breaks the group's connections: the next collective on the driver raises
at once (``RankFailure`` names the rank), which the engine turns into an error for every request it holds.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger('lmd.pytorch_backend')

# how long a collective waits for a rank that is alive but silent (a dead one fails it at once)
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get('LMD_DIST_TIMEOUT', 300)))


class RankFailure(RuntimeError):
    """A tensor-parallel rank is gone: the engine's group cannot run another step."""


def check_parallel_config(config, model_config) -> None:
    """ValueError (ModelFormatError for the model) unless the engine runs ``config``'s ranks: tp and pp on
    CPUs without LoRA adapters, a model ``check_tensor_parallel`` shards, at least a layer per stage of a
    Llama-shaped decoder."""
    from lmd.errors import ModelFormatError
    from lmd.weights.tensor_parallel import check_tensor_parallel

    tp, pp = config.tp, config.pp
    if tp * pp == 1:
        return
    check_tensor_parallel(model_config, tp)
    if pp > 1 and model_config.mla is not None:
        raise ModelFormatError(f'{model_config.architecture}: pipeline parallelism (pp={pp}) runs Llama-shaped '
                               'decoders; its latent attention is not split into stages yet')
    if pp > model_config.num_layers:
        raise ValueError(f'PytorchEngineConfig.pp={pp} is invalid: the model has {model_config.num_layers} '
                         'decoder layers, at least one per stage')
    what = f'PytorchEngineConfig.tp={tp}' if pp == 1 else f'PytorchEngineConfig.tp={tp}, pp={pp}'
    if config.adapters or torch.device(config.device).type != 'cpu':
        raise ValueError(f'{what}: tensor and pipeline parallelism run on CPUs (gloo) without LoRA adapters '
                         'so far' + ('; adapters were given' if config.adapters else f'; device={config.device!r}'))


def make_store(host: str, port: int, is_master: bool) -> dist.Store:
    """The TCP store the ranks meet at (the driver's, ``is_master``; port 0: any free one)."""
    return dist.TCPStore(host, port, None, is_master, TIMEOUT, wait_for_workers=False)


def make_group(store: dist.Store, host: str, rank: int, size: int, name: str = 'lmd-tp') -> dist.ProcessGroup:
    """A gloo process group ``name`` of ``size`` ranks over ``store``; blocks until every rank has joined.
    ``host``: the address this rank listens on for its peers."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore(name + '/', store), rank, size, options)


def make_groups(store: dist.Store, host: str, rank: int, tp: int, pp: int) -> tuple[dist.ProcessGroup,
                                                                                   dist.ProcessGroup | None]:
    """(every rank's group, this rank's stage's tensor-parallel group: the same one without pipeline stages,
    None without tensor parallelism); blocks until their ranks have joined."""
    world = make_group(store, host, rank, tp * pp)
    if pp == 1:
        return world, world if tp > 1 else None
    if tp == 1:
        return world, None
    stage, tp_rank = divmod(rank, tp)
    return world, make_group(store, host, tp_rank, tp, f'lmd-tp-stage{stage}')


class TensorParallel:
    """A model's collectives on one rank: its vocabulary rows, the sums and the gathers of ``tp`` ranks."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, vocab_size: int):
        self.group = group
        self.rank = rank
        self.size = size
        self.vocab_size = vocab_size          # the whole vocabulary's
        self.vocab_rows = -(-vocab_size // size)  # each rank's (the last one's padded)
        self.vocab_start = rank * self.vocab_rows
        self.seconds = 0.0  # spent in collectives, waiting for the other ranks included (benchmarks read it)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place."""
        start = time.perf_counter()
        self.group.allreduce([t]).wait()
        self.seconds += time.perf_counter() - start
        return t

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of the vocabulary-parallel embedding: each rank looks up the ids in its rows, zeros the
        others', and the sum over the ranks is every id's row."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        rows = F.embedding(local.clamp(0, self.vocab_rows - 1), weight)
        rows.masked_fill_(outside[:, None], 0)
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V / tp] logits of this rank's vocabulary rows -> [N, V] of all of it."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        start = time.perf_counter()
        self.group.allgather([parts], [logits.contiguous()]).wait()
        self.seconds += time.perf_counter() - start
        return torch.cat(parts, dim=1)[:, :self.vocab_size]


class RankGroup:
    """The driver's line to the other ranks: sends them what to run, and knows whether they live."""

    def __init__(self, group: dist.ProcessGroup, ranks_alive):
        self.group = group
        self._ranks_alive = ranks_alive  # () -> {rank: None while alive, else how it ended}

    def send(self, message) -> None:
        """Broadcast ``message`` (picklable) from rank 0: its length, then its bytes."""
        try:
            broadcast_object(self.group, message)
        except RuntimeError as e:
            raise self.failure(e) from e

    def failure(self, error: BaseException) -> RankFailure:
        """The error for a collective that failed: which ranks are gone (their end may take a moment to
        be reported after their connections broke), if any is."""
        deadline = time.monotonic() + 5
        while True:
            gone = {r: why for r, why in self._ranks_alive().items() if why is not None}
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if gone:
            what = ', '.join(f'rank {r} {why}' for r, why in sorted(gone.items()))
            return RankFailure(f'parallel ranks: {what}; the engine cannot run more steps')
        return RankFailure(f'parallel ranks: a collective failed: {error}')


def broadcast_object(group: dist.ProcessGroup, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64)
    group.broadcast([size]).wait()
    group.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)]).wait()


def receive_object(group: dist.ProcessGroup):
    size = torch.zeros(1, dtype=torch.int64)
    group.broadcast([size]).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast([data]).wait()
    return pickle.loads(data.numpy().tobytes())


def build_rank_model(model_dir: str, config, rank: int, groups: tuple, num_blocks: int, session_len: int,
                     ranks: RankGroup | None = None):
    """(Rank ``rank``'s ``ModelRunner``, the checkpoint's format): its shard of its stage's layers of the
    model of ``model_dir`` over ``config`` (a PytorchEngineConfig), with ``num_blocks`` KV blocks of its KV
    heads; ``groups``: ``make_groups``'."""
    from lmd.model_config import ModelConfig
    from lmd.weights.dtype import resolve_dtype

    from .loading import load_model
    from .model_runner import ModelRunner
    from .pipeline_parallel import PipelineStage, stage_layers

    tp, pp = config.tp, config.pp
    world, tp_group = groups
    stage, tp_rank = divmod(rank, tp)
    mc = ModelConfig.from_dir(model_dir)
    device = torch.device(config.device)
    layers = stage_layers(mc, pp)[stage] if pp > 1 else None
    model, fmt = load_model(model_dir, mc, config.model_format, resolve_dtype(config.dtype, mc), device,
                            config.kernel_backend, tp_rank, tp, layers)
    if tp > 1:
        model.tp = TensorParallel(tp_group, tp_rank, tp, mc.vocab_size)
    model.build_rope(session_len)
    pipeline = PipelineStage(world, rank, tp, pp, mc) if pp > 1 else None
    runner = ModelRunner(model, num_blocks, config.cache_block_seq_len, device, config.quant_policy, ranks=ranks,
                         stage=pipeline, world=world)
    return runner, fmt


def run_rank(rank: int, model_dir: str, config, host: str, port: int, num_blocks: int, session_len: int,
             num_threads: int) -> None:
    """A rank other than 0, to the end: join the groups, build its shard, then run what the driver sends
    (a ``ModelRunner`` method and its arguments) until it sends None or the group breaks."""
    torch.set_num_threads(num_threads)
    groups = make_groups(make_store(host, port, is_master=False), host_address(host), rank, config.tp, config.pp)
    group = groups[0]
    try:
        runner, _ = build_rank_model(model_dir, config, rank, groups, num_blocks, session_len)
        group.barrier().wait()  # built: the driver may send
        with torch.inference_mode():
            while True:
                message = receive_object(group)
                if message is None:
                    return
                getattr(runner, message[0])(*message[1:])
    except Exception:
        # the driver sees the group break at its next collective; the reason is here
        logger.error('parallel rank %d failed:\n%s', rank, traceback.format_exc())
        raise


def host_address(driver_host: str) -> str:
    """The address this process listens on for its peers: loopback when the driver's is, else this
    node's (as Ray reports it, or the host name's)."""
    if driver_host in ('127.0.0.1', 'localhost'):
        return '127.0.0.1'
    try:
        import ray
        return ray.util.get_node_ip_address()
    except ImportError:
        import socket
        return socket.gethostbyname(socket.gethostname())
