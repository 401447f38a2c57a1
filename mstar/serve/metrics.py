"""Prometheus metrics of one server, in its own registry (``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mstar.engine import Engine
from mstar.engine.async_engine import AsyncEngine
from mstar.engine.resources.kv.tiers import KVTiers, tiers_of

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """Requests, KV pages, the prefix cache, token counters and latencies.

    Engine figures are read on the engine thread: ``on_step`` after each
    step, ``read_engine`` when scraped; request figures on the event loop.
    """

    def __init__(self, aengine: AsyncEngine) -> None:
        self.registry = r = CollectorRegistry()
        Gauge("mstar_requests_running", "Requests producing tokens", registry=r).set_function(
            lambda: aengine.num_running
        )
        Gauge("mstar_requests_waiting", "Requests with no token yet", registry=r).set_function(
            lambda: aengine.num_waiting
        )
        self.pages = Gauge("mstar_kv_pages", "KV pages by state", ["state"], registry=r)
        self.hit_rate = Gauge(
            "mstar_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prompt_tokens = Counter("mstar_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.generation_tokens = Counter(
            "mstar_generation_tokens", "Tokens generated and sent", registry=r
        )
        self.step = Histogram(
            "mstar_step_seconds", "Engine step latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.plan = Histogram(
            "mstar_plan_seconds", "KVManager.plan latency per step", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.drafts = Counter("mstar_spec_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("mstar_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self._spec_seen = (0, 0)  # the engine's counts at the last read
        self.tiers = TierMetrics(r)
        self.ttft = Histogram(
            "mstar_time_to_first_token_seconds", "From request to its first output",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def on_step(self, engine: Engine, seconds: float) -> None:
        self.step.observe(seconds)
        if engine.stats.plan_us:
            self.plan.observe(engine.stats.plan_us[-1] / 1e6)

    def read_engine(self, engine: Engine) -> None:
        mgr = engine.mgr
        free, cached = mgr.num_free_pages, mgr.num_cached_pages
        self.pages.labels("total").set(mgr.num_pages)
        self.pages.labels("used").set(mgr.num_pages - free)
        self.pages.labels("free").set(free)
        self.pages.labels("cached").set(cached)
        seen, self._spec_seen = (
            self._spec_seen,
            (engine.stats.spec_proposed, engine.stats.spec_accepted),
        )
        self.drafts.inc(self._spec_seen[0] - seen[0])
        self.accepted.inc(self._spec_seen[1] - seen[1])
        stats = mgr.prefix_stats()
        self.hit_rate.set(stats["tokens_hit"] / max(1, stats["tokens_queried"]))
        self.tiers.read(tiers_of(engine))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class TierMetrics:
    """The KV tiers' counters (``KVTiers.stats``) per tier: pages asked and
    found, bytes read and written, pages stored (and promoted), evicted and
    bad; hit rates; the time a fetch took."""

    _PAGES = ("queried", "hit", "stored", "promoted", "evicted")

    def __init__(self, r: CollectorRegistry) -> None:
        self.pages = Counter(
            "mstar_kv_tier_pages",
            "KV pages per tier: queried, hit, stored (promoted: of those, copied up from a"
            " later tier), evicted, bad", ["tier", "event"], registry=r,
        )  # fmt: skip
        self.bytes = Counter(
            "mstar_kv_tier_bytes", "KV bytes moved per tier", ["tier", "direction"], registry=r
        )
        self.hit_rate = Gauge(
            "mstar_kv_tier_hit_rate", "Pages found of pages asked, per tier", ["tier"], registry=r
        )
        self.dropped = Counter(
            "mstar_kv_tier_offers_dropped", "Pages not written back: the writer was behind",
            registry=r,
        )  # fmt: skip
        self.load = Histogram(
            "mstar_kv_tier_load_seconds", "Fetching a stream's pages from the tiers",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._seen: dict[str, float] = {}

    def read(self, tiers: KVTiers | None) -> None:
        if tiers is None:
            return
        stats, seen = tiers.stats(), self._seen
        self._seen = stats

        def delta(name: str) -> float:
            return stats.get(name, 0) - seen.get(name, 0)

        for store in tiers.io.stores:
            tier = store.medium.lower()
            for event in self._PAGES:
                self.pages.labels(tier, event).inc(delta(f"{store.medium}_pages_{event}"))
            self.pages.labels(tier, "bad").inc(delta(f"{store.medium}_bad_values"))
            self.bytes.labels(tier, "read").inc(delta(f"{store.medium}_bytes_read"))
            self.bytes.labels(tier, "written").inc(delta(f"{store.medium}_bytes_written"))
            asked = stats.get(f"{store.medium}_pages_queried", 0)
            self.hit_rate.labels(tier).set(
                stats.get(f"{store.medium}_pages_hit", 0) / max(1, asked)
            )
        self.dropped.inc(delta("offers_dropped"))
        for seconds in tiers.io.take_load_seconds():
            self.load.observe(seconds)
