"""`/metrics` of both servers, in Prometheus' text format (prometheus_client), from the scheduler's and
the server's own counters: batch rows and sequences per pass, queue length, sessions, tokens and tokens/s.

Each server has its own registry (several run in one test process) and one collector that reads the
live counters when scraped, so nothing is updated twice.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from moaspec.decoding.engine import Metrics
from moaspec.decoding.prefix_cache import PrefixCache
from moaspec.decoding.scheduler import ROW_BUCKETS, Scheduler


class Rate:
    """Events per second over the last `window_s` seconds (tokens/s for the gauge)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, n: int) -> None:
        self.total += n
        self.events.append((time.monotonic(), n))

    def per_s(self) -> float:
        now = time.monotonic()
        while self.events and self.events[0][0] < now - self.window_s:
            self.events.popleft()
        return sum(n for _, n in self.events) / self.window_s


class Speculation:
    """What speculation did over the finished generations: target calls, draft rows sent to verification and
    accepted. Their ratios are the tau and tree size an operator watches (under load an adaptive tree drafts
    less: `decoding.tree.AdaptiveChain`)."""

    def __init__(self) -> None:
        self.calls = self.drafted = self.accepted = 0

    def add(self, m: Metrics) -> None:
        self.calls += m.target_calls
        self.drafted += m.drafted_tokens
        self.accepted += sum(m.accept_lengths) - m.target_calls

    def gauges(self) -> dict[str, tuple[str, float]]:
        return {"moaspec_target_calls": ("verification passes of finished generations", self.calls),
                "moaspec_draft_tokens": ("draft tokens sent to verification", self.drafted),
                "moaspec_draft_tokens_accepted": ("draft tokens accepted", self.accepted),
                "moaspec_tau": ("tokens per verification pass (1 + accepted drafts)",
                                1 + self.accepted / self.calls if self.calls else 0.0),
                "moaspec_draft_rows_per_call": ("draft tokens per verification pass: the trees' mean size",
                                                self.drafted / self.calls if self.calls else 0.0)}


def _histogram(name: str, doc: str, counts: dict, buckets: tuple, total: float) -> HistogramMetricFamily:
    """A histogram from counts keyed by bucket (or by exact value); `total`: the sum of the observations."""
    cumulative = [(str(b), sum(c for k, c in counts.items() if k <= b)) for b in buckets]
    cumulative.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


class ServerCollector:
    """Reads a scheduler and a server's gauges (`gauges()`: name -> (help, value)) at scrape time."""

    def __init__(self, scheduler: Scheduler, tokens: Rate, gauges: Callable[[], dict[str, tuple[str, float]]]):
        self.scheduler, self.tokens, self.gauges = scheduler, tokens, gauges

    def collect(self) -> Iterator[Metric]:
        s = self.scheduler.stats
        yield CounterMetricFamily("moaspec_passes", "batched forward passes run", value=s.passes)
        yield CounterMetricFamily("moaspec_pass_rows", "rows run in all passes", value=s.rows)
        yield CounterMetricFamily("moaspec_pass_seconds", "time spent in passes", value=s.busy_s)
        # bucket upper bounds hold the passes whose row count was at most that bound
        yield _histogram("moaspec_batch_rows", "rows per batched pass", dict(s.rows_per_pass), ROW_BUCKETS, s.rows)
        yield _histogram("moaspec_batch_sequences", "sequences per batched pass", dict(s.seqs_per_pass),
                         (1, 2, 4, 8, 16, 32, 64), s.sequences)
        yield GaugeMetricFamily("moaspec_pass_queue", "sequences waiting for a pass", value=self.scheduler.queued)
        yield GaugeMetricFamily("moaspec_batched", "1 if passes stack sequences (batch-invariant kernels), "
                                "0 if they run them one after another", value=int(self.scheduler.batched))
        yield GaugeMetricFamily("moaspec_max_wait_passes", "the most passes a sequence waited for its own",
                                value=s.max_wait_passes)
        yield CounterMetricFamily("moaspec_tokens", "tokens generated (verified)", value=self.tokens.total)
        yield GaugeMetricFamily("moaspec_tokens_per_second", f"tokens generated per second over the last "
                                f"{self.tokens.window_s:.0f} s", value=self.tokens.per_s())
        for name, (doc, value) in self.gauges().items():
            yield GaugeMetricFamily(name, doc, value=value)


def registry(collector: ServerCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def exposition(reg: CollectorRegistry) -> tuple[bytes, str]:
    """The body and content type of a /metrics answer."""
    return generate_latest(reg), CONTENT_TYPE_LATEST


def prefix_gauges(prefix: PrefixCache | None) -> dict[str, tuple[str, float]]:
    """The prefix cache's figures (none without one): its memory, entries and how often it answered."""
    if prefix is None:
        return {}
    return {"moaspec_prefix_cache_bytes": ("KV-cache memory kept for prompts that start alike", prefix.nbytes),
            "moaspec_prefix_cache_budget_bytes": ("the prefix cache's budget (--cache-ram)", prefix.budget),
            "moaspec_prefix_cache_entries": ("finished generations' caches kept", len(prefix)),
            "moaspec_prefix_cache_lookups": ("starts that looked for a cached prefix", prefix.lookups),
            "moaspec_prefix_cache_hits": ("starts that found one", prefix.hits),
            "moaspec_prefix_cache_hit_tokens": ("prompt tokens not prefilled thanks to it", prefix.hit_tokens),
            "moaspec_prefix_cache_hit_rate": ("hits / lookups", prefix.hits / prefix.lookups if prefix.lookups
                                              else 0.0),
            "moaspec_prefix_cache_evictions": ("caches evicted for room", prefix.evictions)}
