"""The api_server's Prometheus metrics (``GET /metrics``).

The engine's own counters and gauges (running and waiting requests, KV usage, prefix
cache hits, preemptions, token counts) are read from ``AsyncEngine.stats()`` when Prometheus
scrapes, so they cost nothing per token. Per-request latencies are histograms the
server observes once a request ends. Names follow vLLM's, under the ``lmd:`` prefix.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmd.engine import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine's stats at scrape time; with data-parallel replicas (``--dp``) also each
    replica's requests and prefix-cache counters, labelled ``replica``."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str,
                 replica_stats: Callable[[], list[EngineStats]] | None = None):
        self._stats = stats
        self._replica_stats = replica_stats
        self._labels = ['model_name'], [model_name]

    def collect(self):
        s = self._stats()
        if s is None:  # still loading
            return
        yield from self._engine(s)
        replicas = self._replica_stats() if self._replica_stats is not None else []
        if len(replicas) > 1:
            yield from self._replicas(replicas)

    def _replicas(self, replicas: list[EngineStats]):
        names, values = self._labels

        def family(kind, name, doc, field):
            f = kind(name, doc, labels=[*names, 'replica'])
            for i, r in enumerate(replicas):
                f.add_metric([*values, str(i)], getattr(r, field))
            return f

        yield family(GaugeMetricFamily, 'lmd:replica_num_requests_running', 'Requests each replica is running now.',
                     'num_running')
        yield family(GaugeMetricFamily, 'lmd:replica_num_requests_waiting', 'Requests queued in each replica.',
                     'num_waiting')
        yield family(CounterMetricFamily, 'lmd:replica_prefix_cache_queries',
                     'Prompt tokens each replica looked up in its prefix cache.', 'num_prefix_query_tokens')
        yield family(CounterMetricFamily, 'lmd:replica_prefix_cache_hits',
                     'Prompt tokens each replica served from its prefix cache.', 'num_prefix_hit_tokens')

    def _engine(self, s: EngineStats):
        names, values = self._labels

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge('lmd:num_requests_running', 'Requests the engine is running now.', s.num_running)
        yield gauge('lmd:num_requests_waiting', 'Requests queued in the engine, waiting to run.', s.num_waiting)
        yield gauge('lmd:kv_cache_usage_perc', 'Fraction of KV cache blocks held by requests (1 = full).',
                    s.kv_usage)
        yield gauge('lmd:num_kv_blocks_free', 'KV cache blocks free (cached prefixes not counted).',
                    s.num_free_blocks)
        yield gauge('lmd:num_kv_blocks_total', 'KV cache blocks in all.', s.num_total_blocks)
        hit = s.num_prefix_hit_tokens / s.num_prefix_query_tokens if s.num_prefix_query_tokens else 0.0
        yield gauge('lmd:prefix_cache_hit_rate', 'Prompt tokens served from the prefix cache / prompt tokens '
                    'looked up, since start.', hit)
        yield counter('lmd:prefix_cache_queries', 'Prompt tokens looked up in the prefix cache.',
                      s.num_prefix_query_tokens)
        yield counter('lmd:prefix_cache_hits', 'Prompt tokens served from the prefix cache.', s.num_prefix_hit_tokens)
        yield counter('lmd:num_preemptions', 'Requests preempted because the KV cache ran out.', s.num_preemptions)
        yield counter('lmd:prompt_tokens', 'Prompt tokens prefilled.', s.num_prompt_tokens)
        yield counter('lmd:generation_tokens', 'Tokens generated.', s.num_generated_tokens)
        # speculative decoding (vLLM's spec_decode_* names); the mean acceptance length is
        # 1 + accepted_tokens / drafts
        yield counter('lmd:spec_decode_num_drafts', 'Sequence steps that verified a draft.', s.spec_num_drafts)
        yield counter('lmd:spec_decode_num_draft_tokens', 'Tokens drafted.', s.spec_num_draft_tokens)
        yield counter('lmd:spec_decode_num_accepted_tokens', 'Drafted tokens the model accepted.',
                      s.spec_num_accepted_tokens)


class ServerMetrics:

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None],
                 replica_stats: Callable[[], list[EngineStats]] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name, replica_stats))
        labels = dict(labelnames=['model_name'], registry=self.registry)
        m = model_name
        self.ttft = Histogram('lmd:time_to_first_token_seconds', 'Time from arrival to the first token.',
                              buckets=_LATENCY_BUCKETS, **labels).labels(m)
        self.tpot = Histogram('lmd:time_per_output_token_seconds', 'Mean time between output tokens, per request.',
                              buckets=_TPOT_BUCKETS, **labels).labels(m)
        self.e2e = Histogram('lmd:e2e_request_latency_seconds', 'Time from arrival to the last token.',
                             buckets=_LATENCY_BUCKETS, **labels).labels(m)
        self.queue = Histogram('lmd:request_queue_time_seconds',
                               'Time from arrival until the engine accepted the request (waiting for a slot '
                               'under --max-concurrent-requests included).', buckets=_LATENCY_BUCKETS,
                               **labels).labels(m)
        self.prompt_len = Histogram('lmd:request_prompt_tokens', 'Prompt tokens per request.',
                                    buckets=(16, 64, 256, 1024, 4096, 16384), **labels).labels(m)
        self.gen_len = Histogram('lmd:request_generation_tokens', 'Generated tokens per request.',
                                 buckets=(16, 64, 256, 1024, 4096, 16384), **labels).labels(m)
        self._finished = Counter('lmd:request_success', 'Requests finished, by finish reason.',
                                 labelnames=['model_name', 'finished_reason'], registry=self.registry)
        self._errors = Counter('lmd:request_errors', 'Requests answered with an error, by HTTP status.',
                               labelnames=['model_name', 'status'], registry=self.registry)
        self._model = m

    def finished(self, reason: str | None) -> None:
        self._finished.labels(self._model, reason or 'unknown').inc()

    def error(self, status: int) -> None:
        self._errors.labels(self._model, str(status)).inc()
