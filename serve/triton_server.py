"""Run a real Triton Inference Server without Docker.

The ``nvidia-pytriton`` wheel (``pip install "lmd[triton]"``) carries a complete
``tritonserver`` with its Python backend and a backend stub for each Python
version. ``triton_dist()`` lays it out once under ``~/.cache/lmd/tritonserver``
(binary, backends, the stub for this interpreter); ``TritonServer`` starts it on
a model repository with the environment its Python models need:

- ``LD_LIBRARY_PATH`` holds the wheel's bundled libraries (the copied binary
  loses its relative RPATH) and this interpreter's ``libpython``;
- this interpreter's ``bin/`` comes first on ``PATH``, which is how the stub's
  embedded interpreter finds the environment lmd is installed in;
- the server's working directory is the repository, never a folder that might
  hold a directory named ``triton`` (the stub puts the working directory first
  on ``sys.path``, and ``import triton`` would then shadow OpenAI Triton).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass

from lmd.errors import LmdError

DIST_ROOT = os.environ.get('LMD_TRITON_DIST', os.path.expanduser('~/.cache/lmd/tritonserver'))
INSTALL_HINT = 'pip install "lmd[triton]" (nvidia-pytriton 0.7.0 carries tritonserver 2.51 with its Python backend)'


class TritonNotInstalled(LmdError):
    """No tritonserver can be laid out in this environment."""


class PortInUse(LmdError):
    """A port tritonserver should listen on is taken."""


@dataclass(frozen=True)
class TritonDist:
    """A runnable tritonserver: the binary, its backends and caches, and its bundled libraries."""
    root: str
    libs: str

    @property
    def binary(self) -> str:
        return os.path.join(self.root, 'bin', 'tritonserver')

    @property
    def backends(self) -> str:
        return os.path.join(self.root, 'backends')

    @property
    def caches(self) -> str:
        return os.path.join(self.root, 'caches')


def _pytriton_dir() -> str:
    try:
        import pytriton
    except ImportError as e:
        raise TritonNotInstalled(f'tritonserver is not installed: {INSTALL_HINT}') from e
    src = os.path.join(os.path.dirname(pytriton.__file__), 'tritonserver')
    if not os.path.isfile(os.path.join(src, 'bin', 'tritonserver')):
        raise TritonNotInstalled(f'{src} holds no bin/tritonserver: reinstall with {INSTALL_HINT}')
    return src


def triton_dist() -> TritonDist:
    """The tritonserver of the installed nvidia-pytriton wheel, laid out for this Python (once)."""
    src = _pytriton_dir()
    from importlib.metadata import version
    py = f'{sys.version_info.major}.{sys.version_info.minor}'
    stub = os.path.join(src, 'python_backend_stubs', py, 'triton_python_backend_stub')
    if not os.path.isfile(stub):
        raise TritonNotInstalled(f'nvidia-pytriton has no Python backend stub for Python {py} ({stub} is missing)')
    libs = os.path.join(os.path.dirname(os.path.dirname(src)), 'nvidia_pytriton.libs')
    root = os.path.join(DIST_ROOT, f"{version('nvidia-pytriton')}-py{py}")
    dist = TritonDist(root=root, libs=libs)
    if os.path.isfile(os.path.join(root, '.complete')):
        return dist
    tmp = f'{root}.tmp{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for part in ('bin', 'backends', 'caches'):
        shutil.copytree(os.path.join(src, part), os.path.join(tmp, part), symlinks=True)
    stub_dst = os.path.join(tmp, 'backends', 'python', 'triton_python_backend_stub')
    shutil.copy2(stub, stub_dst)
    for exe in (os.path.join(tmp, 'bin', 'tritonserver'), stub_dst):
        os.chmod(exe, 0o755)
    open(os.path.join(tmp, '.complete'), 'w').close()
    try:
        os.rename(tmp, root)
    except OSError:  # another process laid it out first
        shutil.rmtree(tmp, ignore_errors=True)
    return dist


def server_env(dist: TritonDist) -> dict[str, str]:
    """The environment tritonserver and its Python-backend stubs need (see the module docstring)."""
    env = dict(os.environ)
    paths = [dist.libs]
    libdir = sysconfig.get_config_var('LIBDIR')
    if libdir and os.path.isdir(libdir):
        paths.append(libdir)
    if env.get('LD_LIBRARY_PATH'):
        paths.append(env['LD_LIBRARY_PATH'])
    env['LD_LIBRARY_PATH'] = ':'.join(paths)
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
    return env


def server_args(dist: TritonDist, model_repository: str, http_port: int = 8000, grpc_port: int = 8001,
                metrics_port: int = 8002, address: str = '127.0.0.1', log_verbose: int = 0,
                extra_args: tuple[str, ...] = ()) -> list[str]:
    return [dist.binary, f'--model-repository={os.path.abspath(model_repository)}',
            f'--backend-directory={dist.backends}', f'--cache-directory={dist.caches}',
            f'--http-address={address}', f'--http-port={http_port}',
            f'--grpc-address={address}', f'--grpc-port={grpc_port}',
            f'--metrics-address={address}', f'--metrics-port={metrics_port}',
            '--allow-gpu-metrics=false', '--pinned-memory-pool-byte-size=0', '--exit-on-error=true',
            '--exit-timeout-secs=5', f'--log-verbose={log_verbose}', *extra_args]


class TritonServer:
    """A tritonserver process on ``model_repository``; ``start()`` returns once every model is ready."""

    def __init__(self, model_repository: str, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, address: str = '127.0.0.1', log_path: str | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.model_repository = os.path.abspath(model_repository)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.address = address
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f'{self.address}:{self.http_port}'

    @property
    def grpc_url(self) -> str:
        return f'{self.address}:{self.grpc_port}'

    @property
    def metrics_url(self) -> str:
        return f'http://{self.address}:{self.metrics_port}/metrics'

    def start(self, timeout: float = 600) -> 'TritonServer':
        self._check_ports()
        dist = triton_dist()
        args = server_args(dist, self.model_repository, self.http_port, self.grpc_port, self.metrics_port,
                           self.address, extra_args=self.extra_args)
        self._log = open(self.log_path, 'ab') if self.log_path else None
        self.proc = subprocess.Popen(args, env=server_env(dist), cwd=self.model_repository,
                                     stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                     start_new_session=True)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_ports(self) -> None:
        """A port in use would make tritonserver exit after loading every model (and the readiness check
        could be answered by whoever holds it): say so now."""
        for what, port in (('HTTP', self.http_port), ('gRPC', self.grpc_port), ('metrics', self.metrics_port)):
            with socket.socket() as s:
                try:
                    s.bind((self.address, port))
                except OSError as e:
                    raise PortInUse(f'the {what} port {self.address}:{port} is not free ({e.strerror}): '
                                       f'pick another') from None

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f'http://{self.http_url}/v2/health/ready', timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f'tritonserver exited with status {self.proc.returncode} while loading '
                                   f'{self.model_repository}' + self._log_tail())
            if self.ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f'tritonserver was not ready within {timeout:.0f} s' + self._log_tail())

    def _log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ''
        with open(self.log_path, 'rb') as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n))
            return '\n--- tritonserver log (tail) ---\n' + f.read().decode(errors='replace')

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            try:  # model processes the server left behind (it gives up on them after --exit-timeout-secs)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()
