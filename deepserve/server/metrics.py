"""`/metrics`: Prometheus text from a registry owned by the app (never the global one, so apps don't share).

Engine gauges and counters are read at scrape time from the live engine (queue lengths, KV pages, prefix-cache
and token counters); request latencies (time to first token, inter-token, end to end) and finished requests by
reason are observed by the handlers. With speculative decoding on, the engine's draft counters are exported as
`deepserve_spec_decode_*`: drafted, verified and accepted tokens (totals and per sequence-step, one decoding
request in one step) and the acceptance rate at each draft position. The same numbers are also exported under
vLLM's names where vLLM has a counterpart (`deepserve.server.vllm_metrics`). With cache tiers below the GPU
(`--host-cache-bytes`, `--kv-store`), `deepserve_kv_tier_*{tier="host"|"store"}` count each tier's prefix hits
(tokens, bytes), the seconds requests waited for its reads, the blocks written to it and evicted from it, its
errors and timeouts (each read as a miss) and the writes dropped while too many were in flight. With SWA host
slots (`--swa-host-slots`), `deepserve_swa_slot_*` count the states saved, restored into a next turn, missed
(no usable slot: none found, a payload that failed its checks, or a prefix hit that did not end at the slot's
base) and evicted (reused for another session), with the pool's slots, slots in use and one slot's bytes; with
SWA replay (a store without window snapshots), `deepserve_swa_replays` and `deepserve_swa_replay_tokens`
count the replays and the tokens they recomputed, labelled by `mode` (`exact` or `bounded`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepserve.core.async_engine import AsyncEngine
from deepserve.server.vllm_metrics import VllmCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: how a request ended, as `deepserve_requests_finished_total{reason=...}` counts it
FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The app's registry. `engine` and `num_open` are attached at start-up, when the engine exists."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.engine: AsyncEngine | None = None
        self.admission = None  # deepserve.server.state.Admission, once started
        self.ttft = Histogram("deepserve_time_to_first_token_seconds", "Time from arrival to the first output "
                              "token", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("deepserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("deepserve_e2e_request_latency_seconds", "Time from arrival to the last output",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("deepserve_requests_finished", "Finished generation requests by how they ended "
                                "(abort: the client left or the server stopped it)", ["reason"],
                                registry=self.registry)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.registry.register(_EngineCollector(self))
        self.registry.register(VllmCollector(self, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


def _observe_many(histogram: Histogram, amount: float, count: int) -> None:
    """`histogram.observe(amount)` `count` times, in one pass over the buckets (tokens that arrive together share
    one inter-token gap; at 256 streams one `observe` per token was a tenth of the server's time)."""
    if count == 1 or not hasattr(histogram, "_upper_bounds"):  # (prometheus_client's layout; else the plain way)
        for _ in range(count):
            histogram.observe(amount)
        return
    histogram._sum.inc(amount * count)
    for i, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[i].inc(count)
            return


class RequestTimer:
    """One request's latencies: call `tokens(n)` when n new output tokens arrive, `finish(reason)` once."""

    __slots__ = ("metrics", "start", "last", "done")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics, self.start, self.last, self.done = metrics, time.perf_counter(), None, False

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
            gaps, span = n - 1, 0.0  # tokens that arrived together with the first one
        else:
            gaps, span = n, now - self.last
        if gaps:
            _observe_many(self.metrics.itl, span / gaps, gaps)
        self.last = now

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.finished.labels(reason if reason in FINISH_REASONS else "error").inc()


class _EngineCollector(Collector):
    """Reads the engine's latest snapshot at scrape time (`AsyncEngine.snapshot()`: never the engine's live objects)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        admission = self.metrics.admission
        if admission is not None:
            yield GaugeMetricFamily("deepserve_num_requests_open", "Generation requests the server has admitted "
                                    "and not finished", value=admission.num_open)
            yield CounterMetricFamily("deepserve_requests_rejected", "Requests refused with 429 because the "
                                      "waiting queue was full", value=admission.num_rejected)
        engine = self.metrics.engine
        if engine is None:
            return
        snap = engine.snapshot()  # a value the engine thread published after its latest step
        yield GaugeMetricFamily("deepserve_num_requests_running", "Requests the scheduler is running",
                                value=snap.num_requests_running)
        yield GaugeMetricFamily("deepserve_num_requests_waiting", "Requests waiting for the scheduler to admit "
                                "them", value=snap.num_requests_waiting)
        yield GaugeMetricFamily("deepserve_kv_cache_pages_used", "KV cache pages held by requests",
                                value=snap.num_kv_pages_used)
        yield GaugeMetricFamily("deepserve_kv_cache_pages_total", "KV cache pages in the pool",
                                value=snap.num_kv_pages_total)
        yield CounterMetricFamily("deepserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=snap.num_prefix_queries)
        yield CounterMetricFamily("deepserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=snap.num_prefix_hits)
        yield CounterMetricFamily("deepserve_prompt_tokens", "Prompt tokens computed (prefix-cache hits not "
                                  "included)", value=snap.num_prompt_tokens)
        yield CounterMetricFamily("deepserve_generation_tokens", "Output tokens generated",
                                  value=snap.num_generation_tokens)
        if snap.spec is not None:
            yield from _spec_decode_metrics(snap.spec)
        if snap.kv_tiers:
            yield from _kv_tier_metrics(snap.kv_tiers)
        if snap.swa_slots is not None:
            yield from _swa_slot_metrics(snap.swa_slots)
        if snap.swa_replay is not None:
            yield from _swa_replay_metrics(snap.swa_replay)
        stats = _rank_stats(engine)
        if stats is not None:
            yield from _rank_metrics(stats)
            yield from _eplb_metrics(stats)


def _rank_stats(engine: AsyncEngine):
    """The data-parallel front's `RankStats` (one value, replaced whole after each step), or None for one
    engine."""
    return getattr(engine.engine, "rank_stats", None)


_RANK_METRICS = (
    (GaugeMetricFamily, "num_requests_running", "num_requests_running", "Requests this rank's scheduler is running"),
    (GaugeMetricFamily, "num_requests_waiting", "num_requests_waiting", "Requests waiting on this rank"),
    (GaugeMetricFamily, "kv_cache_pages_used", "num_kv_pages_used", "KV cache pages held by this rank's requests"),
    (GaugeMetricFamily, "kv_cache_pages_total", "num_kv_pages_total", "KV cache pages in this rank's pool"),
    (CounterMetricFamily, "prefix_cache_queries", "num_prefix_queries", "Prompt tokens this rank looked up in its "
     "prefix cache"),
    (CounterMetricFamily, "prefix_cache_hits", "num_prefix_hits", "Prompt tokens found in this rank's prefix cache"),
    (CounterMetricFamily, "prompt_tokens", "num_prompt_tokens", "Prompt tokens this rank computed"),
    (CounterMetricFamily, "generation_tokens", "num_generation_tokens", "Output tokens this rank generated"),
)


def _rank_metrics(stats) -> Iterator[Metric]:
    """Each rank's counters, labelled `rank` (the unlabelled `deepserve_*` above are their sums)."""
    for family, name, field, help_text in _RANK_METRICS:
        metric = family(f"deepserve_rank_{name}", help_text, labels=["rank"])
        for rank, snap in enumerate(stats.snapshots):
            metric.add_metric([str(rank)], getattr(snap, field))
        yield metric


def _eplb_metrics(stats) -> Iterator[Metric]:
    """EPLB's state, once it has counted a step: the latest imbalance per MoE site (slowest rank's tokens over
    the mean, 1 = balanced; sites are the decoder layers in order, then the MTP blocks), its worst, vLLM's
    balancedness (mean over sites of mean / slowest, what vLLM's `log_balancedness` logs), the reassignments
    made and the expert slots they changed (summed over ranks, and per rank)."""
    imbalance = stats.expert_imbalance
    if imbalance is None and not stats.num_rebalances:
        return
    if imbalance is not None:
        per_site = GaugeMetricFamily("deepserve_eplb_imbalance", "EPLB's latest expert-load imbalance of this MoE "
                                     "site: the slowest rank's tokens over the mean (1 = balanced)", labels=["layer"])
        for site, value in enumerate(imbalance):
            per_site.add_metric([str(site)], value)
        yield per_site
        yield GaugeMetricFamily("deepserve_eplb_imbalance_max", "The worst site's latest EPLB imbalance",
                                value=max(imbalance, default=1.0))
        yield GaugeMetricFamily("deepserve_eplb_balancedness", "Mean over MoE sites of mean over slowest rank "
                                "tokens (vLLM's logged EPLB balancedness; 1 = balanced)",
                                value=sum(1 / x for x in imbalance if x > 0) / len(imbalance) if imbalance else 1.0)
    yield CounterMetricFamily("deepserve_eplb_rebalances", "EPLB reassignments made (every rank moves together)",
                              value=stats.num_rebalances)
    yield CounterMetricFamily("deepserve_eplb_slots_moved", "Expert slots whose expert an EPLB reassignment "
                              "changed, summed over ranks and sites", value=sum(stats.num_slots_moved))
    per_rank = CounterMetricFamily("deepserve_rank_eplb_slots_moved", "Expert slots of this rank whose expert an "
                                   "EPLB reassignment changed", labels=["rank"])
    for rank, moved in enumerate(stats.num_slots_moved):
        per_rank.add_metric([str(rank)], moved)
    yield per_rank


_KV_TIER_COUNTERS = (
    ("hit_tokens", "num_hit_tokens", "Prompt tokens served from this cache tier (prefix hits past the GPU pages)"),
    ("hit_bytes", "num_hit_bytes", "KV bytes read from this cache tier for prefix hits"),
    ("load_seconds", "load_seconds", "Seconds requests waited for this cache tier's reads"),
    ("stored_blocks", "num_stored_blocks", "KV blocks written to this cache tier"),
    ("stored_bytes", "num_stored_bytes", "KV bytes written to this cache tier"),
    ("evicted_blocks", "num_evicted_blocks", "KV blocks this cache tier evicted (LRU past its capacity)"),
    ("errors", "num_errors", "Calls to this cache tier that failed or ran past the deadline (read as misses)"),
    ("dropped_writes", "num_dropped_writes", "KV blocks not written to this cache tier: too many writes in flight"),
)


def _kv_tier_metrics(tiers) -> Iterator[Metric]:
    for name, field, help_text in _KV_TIER_COUNTERS:
        family = CounterMetricFamily(f"deepserve_kv_tier_{name}", help_text, labels=["tier"])
        for tier, stats in tiers.items():
            family.add_metric([tier], getattr(stats, field))
        yield family


_SWA_SLOT_METRICS = (
    (CounterMetricFamily, "swa_slot_saves", "num_saves", "Sequences whose window state past their last full page "
     "was saved in an SWA host slot"),
    (CounterMetricFamily, "swa_slot_restores", "num_restores", "Requests that restored their prompt's tail from an "
     "SWA host slot instead of recomputing it"),
    (CounterMetricFamily, "swa_slot_misses", "num_misses", "SWA slot lookups with no usable slot (none saved, a "
     "payload that failed its checks, or a prefix hit that did not end at the slot's base)"),
    (CounterMetricFamily, "swa_slot_corrupt", "num_corrupt", "SWA slot payloads that failed their CRC or layout "
     "check (counted in the misses too)"),
    (CounterMetricFamily, "swa_slot_evictions", "num_evictions", "SWA host slots reused for another session while "
     "theirs was unread"),
    (GaugeMetricFamily, "swa_slots", "num_slots", "SWA host slots in the pool"),
    (GaugeMetricFamily, "swa_slots_used", "num_slots_used", "SWA host slots holding a saved state"),
    (GaugeMetricFamily, "swa_slot_bytes", "slot_bytes", "Bytes of one SWA host slot (MXFP8 window state)"),
)


def _swa_slot_metrics(slots) -> Iterator[Metric]:
    for family, name, field, help_text in _SWA_SLOT_METRICS:
        yield family(f"deepserve_{name}", help_text, value=getattr(slots, field))


def _swa_replay_metrics(replay) -> Iterator[Metric]:
    for name, value, help_text in (
        ("swa_replays", replay.num_replays, "Prefix hits whose window snapshot was rebuilt by SWA replay"),
        ("swa_replay_tokens", replay.num_tokens, "Tokens recomputed by SWA replay"),
    ):
        family = CounterMetricFamily(f"deepserve_{name}", help_text, labels=["mode"])
        family.add_metric([replay.mode], value)
        yield family


def _spec_decode_metrics(spec) -> Iterator[Metric]:
    steps = spec.num_seq_steps
    for what, value, help_text in (
        ("draft", spec.num_draft_tokens, "Draft tokens the proposer made"),
        ("verified", spec.num_verified_tokens, "Draft tokens the target model verified"),
        ("accepted", spec.num_accepted_tokens, "Draft tokens the target model accepted"),
    ):
        yield CounterMetricFamily(f"deepserve_spec_decode_{what}_tokens", help_text, value=value)
        yield GaugeMetricFamily(f"deepserve_spec_decode_{what}_tokens_per_step",
                                f"{help_text}, per decoding sequence per step (since start)",
                                value=value / steps if steps else 0.0)
    yield CounterMetricFamily("deepserve_spec_decode_sequence_steps", "Decoding sequence-steps (one request in "
                              "one step) while speculating", value=steps)
    yield CounterMetricFamily("deepserve_spec_decode_forced_draft_tokens", "Draft tokens that a grammar forced "
                              "(counted in the draft tokens too)", value=spec.num_forced_draft_tokens)
    verified, accepted = list(spec.verified_by_position), list(spec.accepted_by_position)
    by_position = CounterMetricFamily("deepserve_spec_decode_accepted_tokens_by_position",
                                      "Drafts accepted at each draft position (1 = the first draft)",
                                      labels=["position"])
    rate = GaugeMetricFamily("deepserve_spec_decode_acceptance_rate", "Accepted / verified drafts at each draft "
                             "position (1 = the first draft)", labels=["position"])
    checked = CounterMetricFamily("deepserve_spec_decode_verified_tokens_by_position",
                                  "Drafts verified at each draft position", labels=["position"])
    for j, (v, a) in enumerate(zip(verified, accepted), start=1):
        by_position.add_metric([str(j)], a)
        checked.add_metric([str(j)], v)
        rate.add_metric([str(j)], a / v if v else 0.0)
    yield by_position
    yield checked
    yield rate
