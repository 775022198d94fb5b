"""The server's metrics again under vLLM's names (`vllm:*`, labelled `model_name`), so dashboards and autoscalers
built for vLLM read deepserve unchanged. The engine's gauges and counters are also labelled `engine`, as vLLM
labels each engine core's: "0" for one engine, one series per rank behind the data-parallel front (dashboards
sum them); the latency histograms are the front's, labelled `model_name` only. Only metrics with a real counterpart are exported, each from the same
number as its `deepserve_*` twin (read at scrape time: nothing is observed twice):

| vLLM | from |
| --- | --- |
| `vllm:num_requests_running`, `vllm:num_requests_waiting` | the scheduler's queues |
| `vllm:kv_cache_usage_perc` | KV pages used / pages in the pool (a fraction, as vLLM's) |
| `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` | prompt tokens looked up / found |
| `vllm:prompt_tokens_total` | every prompt token: the computed ones plus the prefix-cache hits (vLLM counts both) |
| `vllm:generation_tokens_total` | output tokens |
| `vllm:request_success_total{finished_reason}` | finished requests that ended by `stop`, `length`, `abort` |
| `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds` | the latency histograms |
| `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}` | speculative decoding (positions from 0, as vLLM's) |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from deepserve.server.metrics import ServerMetrics

#: deepserve's histograms and their vLLM names
_HISTOGRAMS = (("ttft", "vllm:time_to_first_token_seconds"), ("itl", "vllm:inter_token_latency_seconds"),
               ("e2e", "vllm:e2e_request_latency_seconds"))
#: the finish reasons vLLM counts in `request_success` (a failed grammar, `error`, has no counterpart)
_SUCCESS_REASONS = ("stop", "length", "abort")


class VllmCollector(Collector):
    """Reads `metrics` (its histograms and finish counter, its engine's snapshot) when scraped."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self.metrics, self.model_name = metrics, model_name

    def collect(self) -> Iterator[Metric]:
        labels = {"model_name": self.model_name}
        for attribute, name in _HISTOGRAMS:
            yield _renamed(getattr(self.metrics, attribute), name, labels)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason",
                                      labels=["model_name", "finished_reason"])
        (finished,) = self.metrics.finished.collect()
        for sample in finished.samples:
            if sample.name.endswith("_total") and sample.labels["reason"] in _SUCCESS_REASONS:
                success.add_metric([self.model_name, sample.labels["reason"]], sample.value)
        yield success
        engine = self.metrics.engine
        if engine is None:
            return
        snap = engine.snapshot()
        stats = getattr(engine.engine, "rank_stats", None)  # data-parallel: one series per rank, as vLLM's engines
        for family, name, help_text, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests running", _running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting", _waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", _kv_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             _prefix_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", _prefix_hits),
            (CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens (computed and prefix-cache hits)", _prompt),
            (CounterMetricFamily, "vllm:generation_tokens", "Generated tokens", _generated),
        ):
            metric = family(name, help_text, labels=["model_name", "engine"])
            for index, one in enumerate(stats.snapshots if stats is not None else (snap,)):
                metric.add_metric([self.model_name, str(index)], value(one))
            yield metric
        if snap.spec is not None:
            yield from self._spec_decode(snap.spec)

    def _spec_decode(self, spec) -> Iterator[Metric]:
        for name, help_text, value in (
            ("vllm:spec_decode_num_drafts", "Sequence-steps that verified drafts", spec.num_seq_steps),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens", spec.num_accepted_tokens),
        ):
            metric = CounterMetricFamily(name, help_text, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft "
                                           "tokens by draft position (0 = the first)", labels=["model_name",
                                                                                               "position"])
        for position, accepted in enumerate(spec.accepted_by_position):
            per_position.add_metric([self.model_name, str(position)], accepted)
        yield per_position


def _running(s) -> float:
    return s.num_requests_running


def _waiting(s) -> float:
    return s.num_requests_waiting


def _kv_usage(s) -> float:
    return s.num_kv_pages_used / s.num_kv_pages_total if s.num_kv_pages_total else 0.0


def _prefix_queries(s) -> float:
    return s.num_prefix_queries


def _prefix_hits(s) -> float:
    return s.num_prefix_hits


def _prompt(s) -> float:
    return s.num_prompt_tokens + s.num_prefix_hits


def _generated(s) -> float:
    return s.num_generation_tokens


def _renamed(histogram, name: str, labels: dict[str, str]) -> Metric:
    """One of deepserve's histograms, its samples renamed and labelled."""
    (family,) = histogram.collect()
    metric = Metric(name, family.documentation, "histogram")
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        metric.add_sample(name + sample.name[len(family.name):], {**sample.labels, **labels}, sample.value)
    return metric
