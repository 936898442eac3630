"""lmd serve proxy, as a black box: real servers on 127.0.0.1 as subprocesses, the official openai client.

Two kinds of nodes sit behind the proxy:
- real lmd api_servers serving the embedded SmolLM2 (the end-to-end tests);
- a small stand-in OpenAI server defined at the bottom of this file (run as
  ``python tests/test_proxy.py standin ...``), whose health, speed and keys a test controls and
  which reports what it saw (streams aborted, Authorization headers). It tests the routing
  rules that a real model server makes slow or nondeterministic to provoke.
"""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN_MODEL = 'standin-model'


# ---- processes ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Server:
    """A subprocess serving HTTP on 127.0.0.1:port, its output in a log file."""

    def __init__(self, name: str, args: list[str], port: int, log_dir, env: dict | None = None):
        self.name, self.port = name, port
        self.url = f'http://127.0.0.1:{port}'
        self.log_path = os.path.join(str(log_dir), f'{name}.log')
        self.log = open(self.log_path, 'w')
        self.proc = subprocess.Popen([sys.executable, *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=os.path.dirname(HERE))

    def wait_ready(self, path: str = '/health', timeout: float = 60.0, ok=(200, 503)):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f'{self.name} exited with {self.proc.returncode}:\n{self.output()}')
            try:
                if httpx.get(self.url + path, timeout=2).status_code in ok:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f'{self.name} did not answer {path} within {timeout} s:\n{self.output()}')

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def stop_all(servers: list[Server]):
    for s in servers:
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in servers:
        s.stop()


def start_proxy(log_dir, *extra: str, interval: float = 0.5) -> Server:
    port = free_port()
    return Server('proxy', ['-m', 'lmd.serve.proxy', '--server-name', '127.0.0.1', '--server-port', str(port),
                            '--health-check-interval', str(interval), '--health-check-timeout', '3', *extra],
                  port, log_dir).wait_ready()


def start_standin(log_dir, name: str, proxy: Server | None, *extra: str) -> Server:
    port = free_port()
    args = [os.path.join(HERE, 'test_proxy.py'), 'standin', '--name', name, '--port', str(port)]
    if proxy is not None:
        args += ['--proxy-url', proxy.url]
    return Server(name, args + list(extra), port, log_dir).wait_ready()


def nodes_status(proxy: Server, key: str | None = None) -> dict:
    headers = {'Authorization': f'Bearer {key}'} if key else {}
    r = httpx.get(proxy.url + '/nodes/status', headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return {n['url']: n for n in r.json()['nodes']}


def wait_for(predicate, what: str, timeout: float = 20.0, show=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f'timed out after {timeout} s waiting for {what}' + (f'; now {show()}' if show else ''))


def wait_nodes(proxy: Server, healthy: dict[str, bool], key: str | None = None) -> dict:
    def ok():
        status = nodes_status(proxy, key)
        return status if all(url in status and status[url]['healthy'] == h for url, h in healthy.items()) else None
    return wait_for(ok, f'node health {healthy}')


def openai_client(server: Server, key: str = 'none', retries: int = 0):
    import openai
    return openai.OpenAI(base_url=server.url + '/v1', api_key=key, max_retries=retries, timeout=60)


def stats(node: Server) -> dict:
    return httpx.get(node.url + '/admin/stats', timeout=5).json()


@pytest.fixture
def spawned():
    """spawned(server) keeps a server to stop when the test ends, however it ends."""
    servers = []

    def keep(server: Server) -> Server:
        servers.append(server)
        return server
    yield keep
    stop_all(servers)


# ---- routing policy, without servers --------------------------------------------------------

def _nodes(*specs):
    from lmd.serve.proxy import Node
    nodes = []
    for i, (unfinished, latencies, speed) in enumerate(specs):
        node = Node(f'http://n{i}:1', healthy=True, unfinished=unfinished, speed=speed)
        node.latencies.extend(latencies)
        nodes.append(node)
    return nodes


def _counts(nodes, strategy, draws=4000):
    from lmd.serve.proxy import choose_node
    rng = random.Random(0)
    return Counter(choose_node(nodes, strategy, rng).url for _ in range(draws))


def test_min_expected_latency_takes_least_unfinished_times_latency():
    # 3 x 1.0 s = 3 vs 1 x 2.0 s = 2 vs 4 x 0.25 s = 1
    nodes = _nodes((3, [1.0], None), (1, [2.0], None), (4, [0.25], None))
    assert _counts(nodes, 'min_expected_latency', 50) == {'http://n2:1': 50}
    # an unmeasured node counts at the mean of the measured ones: 2 x 1.5 > 1 x 2.0
    nodes = _nodes((2, [], None), (1, [2.0], None), (1, [1.0], None))
    assert _counts(nodes, 'min_expected_latency', 50) == {'http://n2:1': 50}
    # idle nodes tie; ties go at random
    counts = _counts(_nodes((0, [5.0], None), (0, [0.1], None), (2, [0.1], None)), 'min_expected_latency')
    assert set(counts) == {'http://n0:1', 'http://n1:1'} and min(counts.values()) > 1700


def test_min_observed_latency_takes_least_mean_latency_and_tries_new_nodes():
    nodes = _nodes((0, [1.0, 3.0], None), (9, [1.5], None), (0, [0.5, 4.0], None))  # means 2, 1.5, 2.25
    assert _counts(nodes, 'min_observed_latency', 50) == {'http://n1:1': 50}
    nodes = _nodes((0, [0.1], None), (0, [], None))
    assert _counts(nodes, 'min_observed_latency', 50) == {'http://n1:1': 50}


def test_random_is_weighted_by_speed():
    counts = _counts(_nodes((0, [], 3.0), (0, [], 1.0)), 'random')
    assert 0.70 < counts['http://n0:1'] / 4000 < 0.80
    # observed latency stands for speed; an unknown node weighs as the mean of the known ones (2 of 1+2+3)
    counts = _counts(_nodes((0, [1.0], None), (0, [1 / 3], None), (0, [], None)), 'random')
    assert 0.12 < counts['http://n0:1'] / 4000 < 0.21 and 0.45 < counts['http://n1:1'] / 4000 < 0.55
    counts = _counts(_nodes((0, [], None), (0, [], None)), 'random')
    assert 0.45 < counts['http://n0:1'] / 4000 < 0.55


def test_bad_settings_are_named():
    from lmd.serve.proxy import ProxyError, build_app, normalize_url
    from lmd.serve.proxy import main as proxy_main
    with pytest.raises(ValueError, match='routing.strategy .fastest. is invalid'):
        build_app('fastest')
    with pytest.raises(ValueError, match='health-check-interval'):
        build_app(health_check_interval=0)
    with pytest.raises(ValueError, match='--nodes: url must look like'):
        build_app(nodes='http://127.0.0.1:1,127.0.0.1:2')
    assert proxy_main(['--routing-strategy', 'fastest']) == 2  # `python -m lmd.serve.proxy`: the CLI's runner
    assert proxy_main(['--server-portt', '1']) == 2
    assert normalize_url('http://127.0.0.1:23333/') == 'http://127.0.0.1:23333'
    for bad in ('127.0.0.1:23333', 'ftp://x:1', 'http://x:99999', '', None, 5):
        with pytest.raises(ProxyError, match='url'):
            normalize_url(bad)


# ---- behind the proxy: stand-in nodes -------------------------------------------------------

@pytest.fixture(scope='module')
def standins(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp('standins')
    proxy = start_proxy(log_dir)
    servers = [proxy]
    try:
        a = start_standin(log_dir, 'a', proxy, '--models', STANDIN_MODEL, 'only-a')
        servers.append(a)
        b = start_standin(log_dir, 'b', proxy, '--models', STANDIN_MODEL)
        servers.append(b)
        wait_nodes(proxy, {a.url: True, b.url: True})
        yield proxy, a, b
    finally:
        stop_all(servers)


def test_standins_register_route_by_model_and_spread(standins):
    proxy, a, b = standins
    client = openai_client(proxy)
    assert sorted(m.id for m in client.models.list().data) == ['only-a', STANDIN_MODEL]
    before = nodes_status(proxy)
    for _ in range(4):
        r = client.chat.completions.create(model='only-a', messages=[{'role': 'user', 'content': 'hi'}])
        assert r.system_fingerprint == 'a' and r.choices[0].message.content == 'a says: hi'
    # concurrent streams: each new one goes to the node with fewer unfinished requests
    streams = []
    for i in range(4):
        s = client.chat.completions.create(model=STANDIN_MODEL, stream=True, max_tokens=40,
                                           messages=[{'role': 'user', 'content': f'stream {i}'}])
        streams.append((s, next(iter(s)).system_fingerprint))
    assert Counter(fp for _, fp in streams) == {'a': 2, 'b': 2}
    status = nodes_status(proxy)
    assert status[a.url]['unfinished'] == 2 and status[b.url]['unfinished'] == 2
    for s, _ in streams:
        assert ''.join(c.choices[0].delta.content or '' for c in s).endswith(' 38 39')
    status = nodes_status(proxy)
    assert status[a.url]['unfinished'] == 0 and status[b.url]['unfinished'] == 0
    assert status[a.url]['requests'] - before[a.url]['requests'] == 6
    assert status[b.url]['requests'] - before[b.url]['requests'] == 2
    assert status[b.url]['latency'] > 0 and sorted(status[a.url]['models']) == ['only-a', STANDIN_MODEL]
    text = client.completions.create(model=STANDIN_MODEL, prompt='one two', max_tokens=3)
    assert text.choices[0].text.endswith(' says: one two 1 2')
    chunks = list(client.completions.create(model=STANDIN_MODEL, prompt='one two', max_tokens=3, stream=True))
    assert ''.join(c.choices[0].text for c in chunks) == f'{chunks[0].system_fingerprint} says: one two 1 2'


def test_node_answering_5xx_on_health_gets_no_requests(standins):
    proxy, a, b = standins
    client = openai_client(proxy)
    httpx.post(a.url + '/admin/health', json={'status': 503}, timeout=5)
    try:
        status = wait_nodes(proxy, {a.url: False, b.url: True})
        assert '503' in status[a.url]['last_error']
        before = stats(a)['requests']
        for _ in range(6):
            r = client.chat.completions.create(model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'hi'}])
            assert r.system_fingerprint == 'b'
        assert stats(a)['requests'] == before
        assert [m.id for m in client.models.list().data] == [STANDIN_MODEL]  # only-a is down with its node
        r = httpx.post(proxy.url + '/v1/chat/completions', timeout=10,
                       json={'model': 'only-a', 'messages': [{'role': 'user', 'content': 'hi'}]})
        assert r.status_code == 503 and r.json()['error']['code'] == 'no_healthy_node'
        assert f'{a.url} (unhealthy: GET /health answered 503)' in r.json()['error']['message']
    finally:
        httpx.post(a.url + '/admin/health', json={'status': 200}, timeout=5)
    wait_nodes(proxy, {a.url: True, b.url: True})
    r = client.chat.completions.create(model='only-a', messages=[{'role': 'user', 'content': 'hi'}])
    assert r.system_fingerprint == 'a'


def test_client_hang_up_closes_the_upstream_stream(standins):
    proxy, a, b = standins
    client = openai_client(proxy)
    aborted = stats(a)['aborted']
    stream = client.chat.completions.create(model='only-a', stream=True, max_tokens=400,
                                            messages=[{'role': 'user', 'content': 'long'}])
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert stats(a)['running'] == 1
    stream.close()
    wait_for(lambda: stats(a)['aborted'] == aborted + 1 and stats(a)['running'] == 0,
             'the stand-in to see the hang-up')
    assert nodes_status(proxy)[a.url]['unfinished'] == 0
    # waiting for a whole answer, then hanging up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.url + '/v1/completions', json={'model': 'only-a', 'prompt': 'x', 'max_tokens': 400},
                   timeout=httpx.Timeout(10, read=1.0))
    wait_for(lambda: stats(a)['aborted'] == aborted + 2 and stats(a)['running'] == 0,
             'the stand-in to see the second hang-up')
    assert nodes_status(proxy)[a.url]['unfinished'] == 0


def test_errors_unknown_model_bad_json_add_and_remove(standins):
    import openai
    proxy, a, b = standins
    client = openai_client(proxy)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model='nope', messages=[{'role': 'user', 'content': 'hi'}])
    assert e.value.body['code'] == 'model_not_found' and 'nope' in e.value.body['message']
    assert e.value.body['param'] == 'model' and e.value.body['type'] == 'not_found_error'
    r = httpx.post(proxy.url + '/v1/chat/completions', content=b'{"model": ', timeout=10)
    assert r.status_code == 400 and 'not valid JSON' in r.json()['error']['message']
    r = httpx.post(proxy.url + '/v1/completions', json={'model': 7, 'prompt': 'x'}, timeout=10)
    assert r.status_code == 400 and r.json()['error']['param'] == 'model'
    r = httpx.get(proxy.url + '/v1/nothing', timeout=10)
    assert r.status_code == 404 and 'error' in r.json()
    for body, param in (({'url': 'localhost:1'}, 'url'), ({}, 'url'), (['x'], None),
                        ({'url': a.url, 'status': {'speed': -1}}, 'status.speed'),
                        ({'url': a.url, 'status': {'models': 'm'}}, 'status.models')):
        r = httpx.post(proxy.url + '/nodes/add', json=body, timeout=10)
        assert r.status_code == 400 and r.json()['error']['param'] == param, r.text
    r = httpx.post(proxy.url + '/nodes/remove', json={'url': 'http://127.0.0.1:1'}, timeout=10)
    assert r.status_code == 404 and 'http://127.0.0.1:1' in r.json()['error']['message']

    r = httpx.post(proxy.url + '/nodes/remove', json={'url': a.url + '/'}, timeout=10)
    assert r.status_code == 200 and r.json() == {'url': a.url, 'removed': True}
    try:
        assert list(nodes_status(proxy)) == [b.url]
        assert [m.id for m in client.models.list().data] == [STANDIN_MODEL]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model='only-a', messages=[{'role': 'user', 'content': 'hi'}])
        for _ in range(3):
            r = client.chat.completions.create(model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'hi'}])
            assert r.system_fingerprint == 'b'
    finally:
        r = httpx.post(proxy.url + '/nodes/add', json={'url': a.url, 'status': {'speed': 2.5}}, timeout=10)
    assert r.status_code == 200, r.text
    node = r.json()
    assert node['healthy'] is True and node['speed'] == 2.5 and sorted(node['models']) == ['only-a', STANDIN_MODEL]
    r = client.chat.completions.create(model='only-a', messages=[{'role': 'user', 'content': 'hi'}])
    assert r.system_fingerprint == 'a'


def test_dead_node_mid_stream_and_refused_connections_are_retried(tmp_path, spawned):
    import openai
    # The nodes are given at the proxy's start (--nodes). The health interval is long: what keeps
    # requests answered here is the retry on another node, not the health check.
    a = spawned(start_standin(tmp_path, 'a', None))
    b = spawned(start_standin(tmp_path, 'b', None))
    proxy = spawned(start_proxy(tmp_path, '--nodes', f'{a.url},{b.url}', interval=60))
    wait_nodes(proxy, {a.url: True, b.url: True})
    client = openai_client(proxy)
    s1 = client.chat.completions.create(model=STANDIN_MODEL, stream=True, max_tokens=400,
                                        messages=[{'role': 'user', 'content': 'x'}])
    it1 = iter(s1)
    first = next(it1).system_fingerprint
    victim, survivor = (a, b) if first == 'a' else (b, a)
    victim.kill()
    with pytest.raises(openai.APIError, match='dropped the stream'):
        for _ in it1:
            pass
    # the proxy has not yet seen a refused connection to the victim
    for i in range(6):
        r = client.chat.completions.create(model=STANDIN_MODEL, messages=[{'role': 'user', 'content': str(i)}])
        assert r.system_fingerprint == survivor.name
    status = nodes_status(proxy)
    assert status[victim.url]['healthy'] is False and status[victim.url]['failures'] >= 1
    assert status[victim.url]['unfinished'] == 0 and status[survivor.url]['unfinished'] == 0
    survivor.kill()
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'x'}])
    assert e.value.status_code == 503 and e.value.body['code'] == 'no_healthy_node'
    assert victim.url in e.value.body['message'] and survivor.url in e.value.body['message']


def test_api_keys(tmp_path, spawned):
    import openai
    proxy = spawned(start_proxy(tmp_path, '--api-keys', 'k1,k2'))
    # the stand-in requires k2 itself and registers with it: the proxy forwards the client's header
    a = spawned(start_standin(tmp_path, 'a', proxy, '--api-key', 'k2'))
    wait_nodes(proxy, {a.url: True}, key='k1')
    for path in ('/v1/models', '/nodes/status'):
        for headers in ({}, {'Authorization': 'Bearer wrong'}, {'Authorization': 'k1'}):
            r = httpx.get(proxy.url + path, headers=headers, timeout=5)
            assert r.status_code == 401, (path, headers)
            assert r.json()['error']['code'] == 'invalid_api_key'
    r = httpx.post(proxy.url + '/nodes/remove', json={'url': a.url}, timeout=5)
    assert r.status_code == 401 and a.url in nodes_status(proxy, 'k2')
    assert httpx.get(proxy.url + '/health', timeout=5).status_code == 200  # open, for load balancers
    with pytest.raises(openai.AuthenticationError):
        openai_client(proxy, 'wrong').chat.completions.create(
            model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'hi'}])
    assert [m.id for m in openai_client(proxy, 'k1').models.list().data] == [STANDIN_MODEL]
    r = openai_client(proxy, 'k2').chat.completions.create(
        model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'hi'}])
    assert r.choices[0].message.content == 'a says: hi'
    # k1 passes the proxy, and the node, which wants k2, answers 401 itself
    with pytest.raises(openai.AuthenticationError, match='stand-in'):
        openai_client(proxy, 'k1').chat.completions.create(
            model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'hi'}])
    assert stats(a)['auth_seen'][-2:] == ['Bearer k2', 'Bearer k1']
    a.stop()  # leaves with POST /nodes/remove, sending its key
    wait_for(lambda: not nodes_status(proxy, 'k1'), 'the stand-in to remove itself')
    assert openai_client(proxy, 'k1').models.list().data == []
    with pytest.raises(openai.InternalServerError) as e:
        openai_client(proxy, 'k1').chat.completions.create(
            model=STANDIN_MODEL, messages=[{'role': 'user', 'content': 'hi'}])
    assert e.value.status_code == 503 and 'no api_server is registered' in e.value.body['message']


# ---- behind the proxy: real lmd api_servers ------------------------------------------------

KEY = 'proxy-test-key'
PROMPT = [{'role': 'user', 'content': 'Name three colors.'}]


def metric(node: Server, name: str) -> float:
    """The api_server's own /metrics figure (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(node.url + '/metrics', timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def served(node: Server) -> float:
    """Requests the api_server has finished."""
    return metric(node, 'lmd:e2e_request_latency_seconds_count')


@pytest.fixture(scope='module', autouse=True)
def launch_cluster(request, tmp_path_factory):
    """A proxy with an API key, and two api_servers serving SmolLM2 that register with it, started
    before this file's first test so that they load while the stand-in tests run."""
    if not any('cluster' in item.fixturenames and item.path == request.path for item in request.session.items):
        yield None
        return
    log_dir = tmp_path_factory.mktemp('cluster')
    proxy = start_proxy(log_dir, '--api-keys', KEY, interval=1.0)
    servers = [proxy]
    try:
        for name in ('node0', 'node1'):
            port = free_port()
            servers.append(Server(name, ['-m', 'lmd.serve.api_server', 'smollm2', '--server-name', '127.0.0.1',
                                         '--server-port', str(port), '--proxy-url', proxy.url, '--api-keys', KEY,
                                         '--num-threads', '1', '--log-level', 'WARNING'],
                                  port, log_dir))
        yield proxy, servers[1:]
    finally:
        stop_all(servers)


@pytest.fixture(scope='module')
def cluster(launch_cluster):
    proxy, nodes = launch_cluster
    for node in nodes:
        node.wait_ready(ok=(200,), timeout=240)
    wait_nodes(proxy, {n.url: True for n in nodes}, key=KEY)
    return proxy, nodes


def test_real_nodes_answer_through_the_proxy(cluster):
    import openai
    proxy, nodes = cluster
    client = openai_client(proxy, KEY)
    assert [m.id for m in client.models.list().data] == ['smollm2']
    answers = [openai_client(n, KEY).chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=12,
                                                              temperature=0) for n in nodes]
    direct = [a.choices[0].message.content for a in answers]
    assert direct[0] == direct[1] and direct[0]
    n_tokens = answers[0].usage.completion_tokens
    before = [served(n) for n in nodes]
    for _ in range(2):
        r = client.chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == direct[0] and r.usage.completion_tokens == n_tokens
    chunks = list(client.chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={'include_usage': True}))
    assert ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices) == direct[0]
    assert chunks[-1].usage.completion_tokens == n_tokens
    text = client.completions.create(model='smollm2', prompt='The sky is', max_tokens=8, temperature=0)
    streamed = client.completions.create(model='smollm2', prompt='The sky is', max_tokens=8, temperature=0,
                                         stream=True)
    assert ''.join(c.choices[0].text for c in streamed) == text.choices[0].text and text.choices[0].text

    # two streams open at once: the second goes to the node without an unfinished request. Each runs
    # 200 tokens (ignore_eos), so the first is still in flight when the second is routed and the
    # status is read (12 tokens can finish first on an idle machine); greedy, each begins with direct[0]
    streams = [client.chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=200, temperature=0,
                                              stream=True, extra_body={'ignore_eos': True}) for _ in range(2)]
    firsts = [next(iter(s)) for s in streams]
    status = nodes_status(proxy, KEY)
    assert [status[n.url]['unfinished'] for n in nodes] == [1, 1]
    for first, s in zip(firsts, streams):
        text = (first.choices[0].delta.content or '') + ''.join(c.choices[0].delta.content or '' for c in s)
        assert text.startswith(direct[0]) and len(text) > len(direct[0])
    after = [served(n) for n in nodes]
    assert sum(after) - sum(before) == 7 and min(a - b for a, b in zip(after, before)) >= 1
    status = nodes_status(proxy, KEY)
    assert all(status[n.url]['latency'] > 0 and status[n.url]['unfinished'] == 0 for n in nodes)

    # a client hanging up mid-stream: the node aborts the request and frees its KV blocks
    generated = [metric(n, 'lmd:generation_tokens') for n in nodes]
    stream = client.chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=300, stream=True,
                                            extra_body={'ignore_eos': True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    wait_for(lambda: sum(metric(n, 'lmd:num_requests_running') for n in nodes) == 0, 'the node to abort')
    assert all(metric(n, 'lmd:num_kv_blocks_free') == metric(n, 'lmd:num_kv_blocks_total') for n in nodes)
    assert sum(metric(n, 'lmd:generation_tokens') for n in nodes) - sum(generated) < 300
    assert all(v['unfinished'] == 0 for v in nodes_status(proxy, KEY).values())

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model='gpt-4', messages=PROMPT, max_tokens=4)
    assert e.value.body['code'] == 'model_not_found' and 'smollm2' in e.value.body['message']
    for key in ('wrong', None):
        r = httpx.post(proxy.url + '/v1/chat/completions', timeout=10,
                       headers={'Authorization': f'Bearer {key}'} if key else {},
                       json={'model': 'smollm2', 'messages': PROMPT, 'max_tokens': 4})
        assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key'
    # a node's own error passes through unchanged
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=4, temperature=-1)
    assert e.value.body['param'] == 'temperature'


def test_real_node_killed_with_requests_in_flight(cluster):
    import openai
    proxy, nodes = cluster
    client = openai_client(proxy, KEY)
    whole = dict(model='smollm2', messages=PROMPT, max_tokens=24, temperature=0, extra_body={'ignore_eos': True})
    expected = client.chat.completions.create(**whole).choices[0].message.content
    # one stream on each node (the second goes to the node without an unfinished request), then four
    # whole-answer requests; the node holding more of them is killed
    streams = [client.chat.completions.create(model='smollm2', messages=PROMPT, max_tokens=64, temperature=0,
                                              stream=True, extra_body={'ignore_eos': True}) for _ in range(2)]
    iters = [iter(s) for s in streams]
    for it in iters:
        next(it)
    answers, errors = [], []

    def ask():
        try:
            answers.append(client.chat.completions.create(**whole).choices[0].message.content)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    # how the four spread depends on the nodes' latencies so far; all six are in flight
    def all_in_flight():
        status = nodes_status(proxy, KEY)
        return status if sum(n['unfinished'] for n in status.values()) == 6 else None
    status = wait_for(all_in_flight, 'six requests in flight', timeout=30, show=lambda: nodes_status(proxy, KEY))
    victim, survivor = sorted(nodes, key=lambda n: -status[n.url]['unfinished'])
    assert status[victim.url]['unfinished'] >= 3 and status[survivor.url]['unfinished'] >= 1
    victim.kill()
    # the stream the victim was answering ends with an error; the whole answers it held are retried
    outcomes = []
    for it in iters:
        try:
            for _ in it:
                pass
            outcomes.append('done')
        except openai.APIError as e:
            assert 'dropped the stream' in str(e)
            outcomes.append('dropped')
    assert sorted(outcomes) == ['done', 'dropped']
    for t in threads:
        t.join(120)
    assert not errors and answers == [expected] * 4
    for i in range(4):
        r = client.completions.create(model='smollm2', prompt=f'{i} plus {i} is', max_tokens=4)
        assert r.choices[0].text
    status = nodes_status(proxy, KEY)
    assert status[victim.url]['healthy'] is False and status[survivor.url]['healthy'] is True
    assert status[victim.url]['unfinished'] == 0 and status[survivor.url]['unfinished'] == 0
    r = httpx.post(proxy.url + '/nodes/remove', json={'url': victim.url}, timeout=10,
                   headers={'Authorization': f'Bearer {KEY}'})
    assert r.status_code == 200 and list(nodes_status(proxy, KEY)) == [survivor.url]


# ---- the stand-in node ----------------------------------------------------------------------

def standin_main(argv: list[str]) -> None:
    """A minimal OpenAI-style server: answers '<name> says: <last message>' (then counting words up
    to max_tokens), streams one word per 20 ms, registers with a proxy like an lmd api_server."""
    import argparse
    import asyncio
    from contextlib import asynccontextmanager

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    parser = argparse.ArgumentParser()
    parser.add_argument('--name', required=True)
    parser.add_argument('--port', type=int, required=True)
    parser.add_argument('--models', nargs='+', default=[STANDIN_MODEL])
    parser.add_argument('--proxy-url')
    parser.add_argument('--api-key')
    args = parser.parse_args(argv)
    url = f'http://127.0.0.1:{args.port}'
    auth = {'Authorization': f'Bearer {args.api_key}'} if args.api_key else {}
    state = {'health': 200, 'running': 0, 'aborted': 0, 'finished': 0, 'requests': 0, 'auth_seen': []}

    @asynccontextmanager
    async def lifespan(app):
        async def register():
            async with httpx.AsyncClient() as c:
                r = await c.post(args.proxy_url + '/nodes/add', json={'url': url}, headers=auth)
                r.raise_for_status()
        task = asyncio.create_task(register()) if args.proxy_url else None
        yield
        if task is not None:
            async with httpx.AsyncClient() as c:
                await c.post(args.proxy_url + '/nodes/remove', json={'url': url}, headers=auth)

    app = FastAPI(lifespan=lifespan)

    def error(status, message):
        return JSONResponse({'error': {'message': message, 'type': 'x', 'param': None, 'code': None}}, status)

    @app.get('/health')
    async def health():
        return Response(status_code=state['health'])

    @app.post('/admin/health')
    async def set_health(request: Request):
        state['health'] = (await request.json())['status']

    @app.get('/admin/stats')
    async def get_stats():
        return state

    @app.get('/v1/models')
    async def models(request: Request):
        if args.api_key and request.headers.get('authorization') != auth['Authorization']:
            return error(401, 'stand-in: wrong key')
        return {'object': 'list', 'data': [{'id': m, 'object': 'model', 'created': 0, 'owned_by': 'standin'}
                                           for m in args.models]}

    async def answer(request: Request, chat: bool):
        state['requests'] += 1
        state['auth_seen'].append(request.headers.get('authorization'))
        if args.api_key and request.headers.get('authorization') != auth['Authorization']:
            return error(401, 'stand-in: wrong key')
        body = await request.json()
        if body.get('model') not in args.models:
            return error(404, f'stand-in: no model {body.get("model")}')
        said = body['messages'][-1]['content'] if chat else body['prompt']
        n = body.get('max_tokens') or 1
        words = [f'{args.name} says: {said}'] + [f' {i}' for i in range(1, n)]
        kind = 'chat.completion' if chat else 'text_completion'
        head = {'id': f'{args.name}-{state["requests"]}', 'created': 0, 'model': body['model'],
                'system_fingerprint': args.name}

        def choice(text, finish):
            if chat:
                return {'index': 0, 'delta': {'content': text}, 'finish_reason': finish}
            return {'index': 0, 'text': text, 'finish_reason': finish}

        if not body.get('stream'):
            state['running'] += 1
            try:
                for _ in words[1:]:  # as if generating: one word per 20 ms
                    if await request.is_disconnected():
                        state['aborted'] += 1
                        return Response(status_code=499)
                    await asyncio.sleep(0.02)
                state['finished'] += 1
            finally:
                state['running'] -= 1
            content = ''.join(words)
            c = ({'index': 0, 'message': {'role': 'assistant', 'content': content}, 'finish_reason': 'length'}
                 if chat else {'index': 0, 'text': content, 'finish_reason': 'length'})
            return {**head, 'object': kind, 'choices': [c]}

        async def events():
            state['running'] += 1
            done = False
            try:
                for i, w in enumerate(words):
                    chunk = {**head, 'object': kind + ('.chunk' if chat else ''),
                             'choices': [choice(w, 'length' if i == len(words) - 1 else None)]}
                    yield f'data: {json.dumps(chunk)}\n\n'
                    await asyncio.sleep(0.02)
                yield 'data: [DONE]\n\n'
                done = True
            finally:
                state['running'] -= 1
                state['finished' if done else 'aborted'] += 1
        return StreamingResponse(events(), media_type='text/event-stream')

    @app.post('/v1/chat/completions')
    async def chat(request: Request):
        return await answer(request, True)

    @app.post('/v1/completions')
    async def completions(request: Request):
        return await answer(request, False)

    uvicorn.run(app, host='127.0.0.1', port=args.port, log_level='warning')


if __name__ == '__main__' and sys.argv[1:2] == ['standin']:
    standin_main(sys.argv[2:])
