"""The server's counters, exposed through `prometheus_client` (text format 0.0.4).

Each `Metrics` is the one collector of its own `CollectorRegistry`, never the global one,
so several servers in one process (the tests start many) neither share nor collide. The
state stays plain numbers under one lock, turned into metric families by `collect` at
scrape time, rather than `Counter`/`Gauge` objects: 8 of the 23 families are computed or
read when scraped (the acceptance length and batch occupancy means, acceptance by
position, the prefix cache's own counters); one hold of the lock keeps a scrape consistent
(the acceptance length from the same rounds and accepted counts); and families add no
`_created` series. The names, labels, types and help texts are those of the hand-written
exposition this replaced; only integers now print as floats (2.0 for 2).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from specx.runtime.prefix_cache import PrefixCache
    from specx.server.events import Finished

__all__ = ["Metrics"]

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class Metrics(Collector):
    """Requests, tokens, acceptance, round timings, queue depth and batch occupancy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status code) -> count
        self.finish: Counter = Counter()  # finish reason -> count
        self.prompt_tokens = self.generation_tokens = 0
        self.rounds = self.drafted = self.accepted = 0
        self.position_hits: defaultdict[int, float] = defaultdict(float)  # depth d -> summed rates
        self.position_seen: Counter = Counter()
        self.draft_s = self.draft_prefill_s = self.verify_s = self.round_s = 0.0
        self.queue_wait_s = 0.0
        self.batch_rounds = self.batch_rows = 0  # for the mean occupancy
        self.queue_depth = self.running = self.slots = 0
        self.prefix_cache: PrefixCache | None = None  # its own counters, read at scrape
        self.build = self.build_reason = ""  # which build serves, and why (the engine's)
        self.registry = CollectorRegistry()  # this server's own, never the global one
        self.registry.register(self)

    def request(self, endpoint: str, status: int) -> None:  # noqa: D102
        with self._lock:
            self.requests[endpoint, status] += 1

    def request_counts(self) -> dict[tuple[str, int], int]:
        """A copy of the (endpoint, status) counts: what a Ray gateway hands a replica to show."""
        with self._lock:
            return dict(self.requests)

    def admitted(self, waited_s: float) -> None:  # noqa: D102
        with self._lock:
            self.queue_wait_s += waited_s

    def round(  # noqa: D102
        self, running: int, round_s: float, draft_s: float, draft_prefill_s: float, verify_s: float
    ) -> None:
        with self._lock:
            self.running = running
            self.batch_rounds += 1
            self.batch_rows += running
            self.round_s += round_s
            self.draft_s += draft_s
            self.draft_prefill_s += draft_prefill_s
            self.verify_s += verify_s

    def finished(self, done: Finished) -> None:  # noqa: D102
        with self._lock:
            self.finish[done.finish_reason] += 1
            self.prompt_tokens += done.prompt_tokens
            self.generation_tokens += len(done.tokens)
            self.rounds += done.rounds
            self.drafted += done.drafted
            self.accepted += done.accepted
            for d, rate in enumerate(done.acceptance_by_position, 1):
                self.position_hits[d] += rate
                self.position_seen[d] += 1

    def render(self, requests: Mapping[tuple[str, int], int] | None = None) -> str:
        """The exposition text.

        `requests`: (endpoint, status) counts kept elsewhere, shown instead of this one's: a
        Ray replica shows its gateway's, which sees every response (`specx.server.ray_serve`).
        """
        if requests is None:
            return generate_latest(self.registry).decode()
        return generate_latest(_Collected(self._families(requests))).decode()

    def collect(self) -> Iterator[Metric]:
        """Every family, read in one hold of the lock."""
        return iter(self._families(None))

    def _families(self, shown: Mapping[tuple[str, int], int] | None) -> list[Metric]:
        with self._lock:
            requests = CounterMetricFamily(
                "specx_requests_total",
                "HTTP requests by endpoint and status",
                labels=("endpoint", "status"),
            )
            counts = self.requests if shown is None else shown
            for (endpoint, status), n in sorted(counts.items()):
                requests.add_metric((endpoint, str(status)), n)
            finish = CounterMetricFamily(
                "specx_finished_total", "Requests ended, by reason", labels=("reason",)
            )
            for reason, n in sorted(self.finish.items()):
                finish.add_metric((reason,), n)
            by_position = GaugeMetricFamily(
                "specx_acceptance_by_position",
                "Mean per-request P(accepted >= d)",
                labels=("position",),
            )
            for d in sorted(self.position_seen):
                by_position.add_metric((str(d),), self.position_hits[d] / self.position_seen[d])
            scalars = [
                _FAMILIES[kind](f"specx_{name}", help_, value=value)
                for name, kind, help_, value in self._scalar_rows()
            ]
        info = {"build": self.build, "reason": self.build_reason}
        build = InfoMetricFamily("specx_build", "The build serving, and why", value=info)
        return [requests, finish, *scalars, by_position, build]

    def _scalar_rows(self) -> list[tuple[str, str, str, float]]:
        return [
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled", self.prompt_tokens),
            ("generation_tokens_total", "counter", "Tokens generated", self.generation_tokens),
            ("rounds_total", "counter", "Verify rounds, summed over requests", self.rounds),
            ("draft_tokens_total", "counter", "Draft nodes verified", self.drafted),
            ("accepted_tokens_total", "counter", "Draft tokens accepted", self.accepted),
            ("acceptance_length", "gauge", "Mean tokens per round (bonus counted)",
             (self.rounds + self.accepted) / self.rounds if self.rounds else 0.0),
            ("draft_seconds_total", "counter", "Time drafting in rounds", self.draft_s),
            ("draft_prefill_seconds_total", "counter", "Time drafters prefilled prompts",
             self.draft_prefill_s),
            ("verify_seconds_total", "counter", "Time in verify forwards", self.verify_s),
            ("round_seconds_total", "counter", "Time in decoding rounds", self.round_s),
            ("queue_wait_seconds_total", "counter", "Time requests waited", self.queue_wait_s),
            ("queue_depth", "gauge", "Requests waiting for a slot", self.queue_depth),
            ("batch_running", "gauge", "Sequences in the running batch", self.running),
            ("batch_slots", "gauge", "KV slots of the batch", self.slots),
            ("batch_occupancy", "gauge", "Mean running sequences per round",
             self.batch_rows / self.batch_rounds if self.batch_rounds else 0.0),
            *self._prefix_cache_rows(),
        ]  # fmt: skip

    def _prefix_cache_rows(self) -> list[tuple[str, str, str, float]]:
        cache = self.prefix_cache
        if cache is None:
            return []
        return [
            ("prefix_cache_hits_total", "counter", "Prompts that reused a cached prefix",
             cache.hits),
            ("prefix_cache_reused_tokens_total", "counter", "Prompt tokens not prefilled",
             cache.reused_tokens),
            ("prefix_cache_evictions_total", "counter", "Blocks evicted", cache.evictions),
            ("prefix_cache_bytes", "gauge", "Bytes of cached blocks", cache.bytes),
            ("prefix_cache_max_bytes", "gauge", "The bound", cache.max_bytes),
        ]  # fmt: skip


class _Collected(Collector):
    """Families already collected, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:  # noqa: D102
        return iter(self.families)
