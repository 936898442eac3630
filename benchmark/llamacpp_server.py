"""compare_llamacpp.py's llama-server side: the worker that starts ``llama-server`` on the GGUF with one slot
a concurrent request, sends the concurrent round's prompts as token ids to ``/completion`` (greedy, EOS
ignored, no prompt cache), and reports the round as the other sides do, with the server's own prompt and
per-token timings (a non-streaming client sees only each request's end), its CPU use and peak RSS."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from common import RequestTiming, concurrent_round, llamacpp_extra_bufts, percentiles
from prompts import Prompt


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def server_request(base: str, prompt: Prompt, t0: float, timeout: float) -> tuple[RequestTiming, dict]:
    """One non-streamed greedy completion of ``prompt``'s token ids (no prompt cache, EOS ignored)."""
    body = {'prompt': list(prompt.token_ids), 'n_predict': prompt.output_len, 'ignore_eos': True,
            'temperature': 0.0, 'top_k': 1, 'cache_prompt': False, 'stream': False}
    r = post_json(base + '/completion', body, timeout)
    done = time.perf_counter()
    t = r.get('timings', {})
    n = int(r.get('tokens_predicted', t.get('predicted_n', 0)))
    timing = RequestTiming(t0, prompt.output_len)
    # the server's own split: prompt time, then the rest; the client sees only the end
    first = done - t.get('predicted_ms', 0) / 1000 + (t.get('predicted_per_token_ms', 0) / 1000 if n else 0)
    timing.add(min(first, done), 1)
    timing.add(done, n)
    return timing, t


def server_worker(args, work: dict, warmup_tokens: int) -> dict:
    """The concurrent round on llama-server (its repacked weight buffers as ``--llamacpp-extra-bufts`` says;
    a warm-up of two requests of ``warmup_tokens`` first)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    conc = work['concurrency']
    longest = max(len(p['ids']) + p['out'] for p in work['concurrent'])
    n_ctx = conc * (longest + 16)  # each slot gets n_ctx / np
    repack = [] if llamacpp_extra_bufts(args.llamacpp_extra_bufts) else ['--no-repack']
    cmd = [args.server, '-m', args.gguf, *repack, '-t', str(args.num_threads), '-tb', str(args.num_threads),
           '-np', str(conc), '-cb', '-c', str(n_ctx), '--host', '127.0.0.1', '--port', str(port)]
    with tempfile.TemporaryFile('w+') as log_file:
        return _serve_and_run(args, work, cmd, port, log_file, warmup_tokens)


def _serve_and_run(args, work: dict, cmd: list[str], port: int, log_file, warmup_tokens: int) -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    base = f'http://127.0.0.1:{port}'
    try:
        while True:
            if proc.poll() is not None:
                log_file.seek(0)
                raise RuntimeError(f'llama-server exited with {proc.returncode}: {log_file.read()[-2000:]}')
            try:
                with urllib.request.urlopen(base + '/health', timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() - t > 300:
                raise RuntimeError('llama-server did not become healthy within 300 s')
            time.sleep(0.2)
        result = {'engine': 'llama.cpp llama-server', 'command': ' '.join(cmd), 'gguf': args.gguf,
                  'load_s': round(time.perf_counter() - t, 2)}
        prompts = [Prompt(tuple(p['ids']), p['out']) for p in work['concurrent']]
        server_timings: list[dict] = []

        def run(ps: list[Prompt]) -> list[RequestTiming]:
            t0 = time.perf_counter()
            out: list = [None] * len(ps)

            def one(i):
                out[i] = server_request(base, ps[i], t0, args.timeout)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if any(o is None for o in out):
                raise RuntimeError('a llama-server request failed (see stderr)')
            server_timings[:] = [o[1] for o in out]
            return [o[0] for o in out]

        cpu0 = server_cpu_seconds(proc.pid)
        run([Prompt(p.token_ids[:16], warmup_tokens) for p in prompts[:2]])
        t_run = time.perf_counter()
        res = concurrent_round(run, prompts, 'llama-server')
        # only end-to-end is seen by a non-streaming client: TTFT/TPOT below come from the server's timings
        for k in ('ttft_s', 'tpot_s', 'itl_s'):
            res.pop(k, None)
        res['server_prompt_ms'] = percentiles([s.get('prompt_ms', 0) for s in server_timings], 1)
        res['server_predicted_per_token_ms'] = percentiles([s.get('predicted_per_token_ms', 0)
                                                            for s in server_timings], 2)
        result['concurrent'] = res
        result['server_cpu_utilization'] = round((server_cpu_seconds(proc.pid) - cpu0)
                                                 / (time.perf_counter() - t_run), 2)
        result['server_peak_rss_mib'] = server_peak_rss_mib(proc.pid)
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def server_cpu_seconds(pid: int) -> float:
    with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')  # utime + stime


def server_peak_rss_mib(pid: int) -> float:
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return round(int(line.split()[1]) / 1024, 1)
    return float('nan')
