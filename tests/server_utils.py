"""Start real lmd servers on 127.0.0.1 for tests: a subprocess each, logs kept for failures."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def interruptible() -> None:
    """``preexec_fn`` for a client whose Ctrl+C is under test: a job a shell starts in the background
    ignores SIGINT, its children inherit that, and Python then installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m lmd.serve.<module> ARGS --server-name 127.0.0.1 --server-port PORT``."""

    def __init__(self, module: str, args: list[str], port: int | None = None, env: dict | None = None,
                 health_path: str = '/health'):
        self.port = port or free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        self.log = tempfile.NamedTemporaryFile('w+', prefix=f'lmd-{module}-', suffix='.log', delete=False)
        cmd = [sys.executable, '-m', f'lmd.serve.{module}', *args, '--server-name', '127.0.0.1',
               '--server-port', str(self.port)]
        full_env = dict(os.environ, PYTHONUNBUFFERED='1', **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.health_path = health_path

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding='utf-8', errors='replace') as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> 'ServerProcess':
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f'server exited with {self.proc.returncode}:\n{self.logs()[-4000:]}')
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        logs = self.logs()  # before stop() closes the log
        self.stop()
        raise RuntimeError(f'server not healthy after {timeout} s:\n{logs[-4000:]}')

    def kill(self) -> None:
        """SIGKILL: the server dies without cleaning up, as a crashed node would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def api_server(model: str, *args: str, port: int | None = None, env: dict | None = None) -> ServerProcess:
    return ServerProcess('api_server', [model, *args], port=port, env=env)


def metric(url: str, name: str, **labels) -> float:
    """One sample's value from a server's /metrics (summed over label sets matching ``labels``)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + '/metrics', timeout=10).text
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    if not found:
        raise KeyError(f'{name} not in /metrics')
    return total


def tiny_model_dir(out_dir: str, smollm2_dir: str, seed: int = 0) -> str:
    """A tiny random Llama over SmolLM2's tokenizer and chat template: fast to serve, real text in and out."""
    import shutil

    import transformers

    from tiny_models import tiny_hf_model
    vocab = transformers.AutoTokenizer.from_pretrained(smollm2_dir).vocab_size
    model, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', seed=seed, vocab_size=vocab, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
        src = os.path.join(smollm2_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, out_dir)
    return out_dir
