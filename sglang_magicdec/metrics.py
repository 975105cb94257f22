"""MagicDec in SGLang's Prometheus metrics (`--enable-metrics`).

SGLang's scheduler exports the speculative gauges `sglang:spec_accept_length`,
`sglang:spec_accept_rate`, `sglang:spec_num_steps` and `sglang:spec_num_draft_tokens` every
`--decode-log-interval` decode batches, reading the last two from the speculative worker's
`speculative_num_steps` and `speculative_num_draft_tokens` (our worker answers with the γ of its
latest decode batch). MagicDec's own counters and its γ are published beside them, with the
scheduler collector's labels, after every decode batch. SGLang offers no seam for a worker's
metrics, so an AFTER hook on `SchedulerMetricsReporter.report_decode_stats` (the call that follows
each decode batch) hands the collector's labels to the worker.
"""

from __future__ import annotations

REPORT_DECODE_STATS = (
    "sglang.srt.managers.scheduler_components.metrics_reporter."
    "SchedulerMetricsReporter.report_decode_stats"
)

# Why a decode batch ran without drafts: the cost model chose γ = 0 (γ = auto), or the batch has
# something a round does not follow (`MagicDecWorker._cannot_speculate`).
PLAIN_REASONS = ("cost_model", "grammar", "custom_logit_processor")

# Worker counter (as in `/server_info`'s `magicdec` block) -> (metric, documentation).
COUNTERS = {
    "verify_rounds": (
        "sglang:magicdec_request_rounds_total",
        "(request, verify pass) pairs MagicDec ran.",
    ),
    "summaries_computed": (
        "sglang:magicdec_summaries_computed_total",
        "SnapKV summaries computed (one per distinct prompt prefix).",
    ),
    "summaries_reused": (
        "sglang:magicdec_summaries_reused_total",
        "Requests that drafted with a summary another request computed (a shared prefix).",
    ),
    "drafts_without_summary": (
        "sglang:magicdec_drafts_without_summary_total",
        "Requests that drafted with the streaming fallback (no SnapKV summary).",
    ),
}


class MagicDecMetrics:
    """MagicDec's counters and γ gauge, labelled like the scheduler's own metrics."""

    def __init__(self, labels: dict[str, str]) -> None:
        # Imported here: prometheus_client must load after SGLang set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import Counter, Gauge

        # Each metric is labelled once, here: publishing then looks up no label set, and a count
        # still at 0 is exported as 0, not missing.
        self.gamma = Gauge(
            name="sglang:magicdec_gamma",
            documentation="γ of MagicDec's latest decode batch (0: it decoded without drafts).",
            labelnames=labels.keys(),
            multiprocess_mode="mostrecent",
        ).labels(**labels)
        self.counters = {
            key: Counter(name=name, documentation=doc, labelnames=labels.keys()).labels(**labels)
            for key, (name, doc) in COUNTERS.items()
        }
        self.published = dict.fromkeys(COUNTERS, 0)
        plain = Counter(
            name="sglang:magicdec_plain_batches_total",
            documentation="Decode batches MagicDec ran as plain steps (no drafts), by reason "
            "(cost_model: γ = auto chose 0; grammar, custom_logit_processor).",
            labelnames=[*labels.keys(), "reason"],
        )
        self.plain_batches = {
            reason: plain.labels(**labels, reason=reason) for reason in PLAIN_REASONS
        }
        self.published_plain = dict.fromkeys(PLAIN_REASONS, 0)

    def publish(self, counts: dict[str, int], plain_batches: dict[str, int], gamma: int) -> None:
        """Set γ and bring each counter up to the worker's lifetime count."""
        self.gamma.set(gamma)
        for key, counter in self.counters.items():
            self.published[key] += _catch_up(counter, counts.get(key, 0), self.published[key])
        for reason, counter in self.plain_batches.items():
            count, published = plain_batches.get(reason, 0), self.published_plain[reason]
            self.published_plain[reason] += _catch_up(counter, count, published)


def _catch_up(counter, count: int, published: int) -> int:
    """Increase `counter` from `published` to `count`; returns by how much."""
    increase = max(count - published, 0)
    if increase:
        counter.inc(increase)
    return increase


def publish_after_decode(result, reporter, *args, **kwargs):
    if reporter.current_scheduler_metrics_enabled:
        publish = getattr(reporter.scheduler.draft_worker, "publish_metrics", None)
        if publish is not None:
            publish(reporter.metrics_collector.labels)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(REPORT_DECODE_STATS, publish_after_decode, HookType.AFTER)
