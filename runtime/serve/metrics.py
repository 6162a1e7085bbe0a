"""Prometheus metrics of `specrt serve` (served at GET /metrics), in a registry owned by one app."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from ..batch_policy import REASONS
from ..core import StepReport

PRIOR_ALPHA = 0.6  # α assumed before anything was proposed (GammaController's prior)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """Every metric the server exports. ``observe_step`` is called by the engine worker after each step."""

    def __init__(self, registry: CollectorRegistry | None = None, max_batch: int = 1, policy=None,
                 current_alpha=None, prefix_hit_tokens=None):
        r = self.registry = registry or CollectorRegistry()
        self.max_batch = max_batch  # the server's --max-batch (range of specrt_policy_speculation_max_batch)
        self.policy = policy  # the generator's SpeculationPolicy (None: no policy gauges)
        self.current_alpha = current_alpha  # () -> recent acceptance over all sequences (None: since start)
        self.prefix_hit_tokens = prefix_hit_tokens  # () -> prompt tokens the prefix cache skipped so far (None: none)
        self.requests = Counter("specrt_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("specrt_request_duration_seconds", "Time from request to its last byte",
                                         ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specrt_time_to_first_token_seconds", "Time from request to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("specrt_queue_wait_seconds", "Time a request waited in the queue for its slots",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("specrt_inter_token_latency_seconds",
                                     "Time between a choice's streamed tokens (a round's tokens share its gap)",
                                     buckets=LATENCY_BUCKETS, registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds
        self.prompt_tokens = Counter("specrt_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.prefix_hits = Counter("specrt_prefix_cache_hit_tokens",
                                   "Prompt tokens whose K/V came from the prefix cache (not prefilled), since start",
                                   registry=r)
        self._prefix_seen = 0  # prefix_hit_tokens() at the last render
        self.generated_tokens = Counter("specrt_generated_tokens",
                                        "Generated tokens of completed requests (usage.completion_tokens)", registry=r)
        self.cancelled = Counter("specrt_requests_cancelled",
                                 "Requests cancelled (client disconnect); their slot was freed", registry=r)
        self.failed = Counter("specrt_requests_failed", "Requests the engine failed while generating", registry=r)
        self.steps = Counter("specrt_steps", "Engine steps (one target pass for the whole batch each)", registry=r)
        self.speculative_steps = Counter("specrt_speculative_steps", "Engine steps that speculated (gamma > 0)",
                                         registry=r)
        self.step_tokens = Counter("specrt_step_tokens", "Tokens produced by engine steps", registry=r)
        self.sequence_passes = Counter("specrt_sequence_passes",
                                       "Sequences advanced by engine steps (batch size summed over steps)",
                                       registry=r)
        self.proposed = Counter("specrt_proposed_tokens", "Draft tokens proposed for verification", registry=r)
        self.accepted = Counter("specrt_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.acceptance_rate = Gauge("specrt_acceptance_rate", "Accepted / proposed draft tokens since start",
                                     registry=r)
        self.tokens_per_pass = Gauge("specrt_tokens_per_target_pass",
                                     "Tokens per sequence per target pass since start (1 = no speculation gain)",
                                     registry=r)
        self.tokens_per_second = Gauge("specrt_tokens_per_second",
                                       "Tokens per second of recent engine steps (EWMA)", registry=r)
        self.batch_size = Gauge("specrt_batch_size", "Sequences currently in the batch (occupied slots)",
                                registry=r)
        self.queue_depth = Gauge("specrt_queue_depth", "Requests waiting for a slot", registry=r)
        self.speculation = Gauge("specrt_speculation_enabled", "1 if the latest step speculated (gamma > 0)",
                                 registry=r)
        self.gamma = Gauge("specrt_gamma", "Draft length gamma of the latest step", registry=r)
        self.decision = Gauge("specrt_policy_decision", "Why the latest step ran its gamma (1 for the reason)",
                              ["reason"], registry=r)
        self.predicted_speedup = Gauge("specrt_policy_predicted_speedup",
                                       "Policy's predicted throughput gain of the latest step's gamma over gamma 0",
                                       registry=r)
        self.max_spec_batch = Gauge("specrt_policy_speculation_max_batch",
                                    "Largest batch size at which the policy currently speculates "
                                    "(measured costs, current acceptance)", registry=r)
        self._tps = None  # EWMA tokens/s
        self._totals = {"tokens": 0, "sequence_passes": 0, "proposed": 0, "accepted": 0}
        for reason in REASONS:
            self.decision.labels(reason).set(0)

    def render(self) -> bytes:
        """The text exposition; the policy's batch limit is computed here, not in the engine's hot loop."""
        t = self._totals
        if self.prefix_hit_tokens is not None:  # the core counts them at admission; the counter catches up here
            total = self.prefix_hit_tokens()
            self.prefix_hits.inc(max(0, total - self._prefix_seen))
            self._prefix_seen = total
        if self.policy is not None and self.policy.config.fixed_gamma is None:
            if self.current_alpha is not None:
                alpha = self.current_alpha()
            else:
                alpha = t["accepted"] / t["proposed"] if t["proposed"] else PRIOR_ALPHA
            self.max_spec_batch.set(self.policy.max_speculative_batch(alpha, self.max_batch))
        return generate_latest(self.registry)

    def observe_cancel(self, handle) -> None:
        """Worker hook: a request was cancelled (its client went away) and its slots freed."""
        self.cancelled.inc()

    def observe_step(self, report: StepReport | None, active: int, queued: int) -> None:
        """Worker hook: the batch and queue after a step or admission; the step's own numbers."""
        self.batch_size.set(active)
        self.queue_depth.set(queued)
        if report is None:
            return
        self.steps.inc()
        if report.gamma > 0:
            self.speculative_steps.inc()
        self.step_tokens.inc(report.tokens)
        self.sequence_passes.inc(report.batch_size)
        self.proposed.inc(report.proposed)
        self.accepted.inc(report.accepted)
        t = self._totals
        t["tokens"] += report.tokens
        t["sequence_passes"] += report.batch_size
        t["proposed"] += report.proposed
        t["accepted"] += report.accepted
        self.acceptance_rate.set(t["accepted"] / t["proposed"] if t["proposed"] else 0.0)
        self.tokens_per_pass.set(t["tokens"] / max(t["sequence_passes"], 1))
        if report.seconds > 0:
            tps = report.tokens / report.seconds
            self._tps = tps if self._tps is None else 0.9 * self._tps + 0.1 * tps
            self.tokens_per_second.set(self._tps)
        self.speculation.set(1 if report.gamma > 0 else 0)
        self.gamma.set(report.gamma)
        for reason in REASONS:
            self.decision.labels(reason).set(1 if report.decision.reason == reason else 0)
        self.predicted_speedup.set(report.decision.predicted_speedup)
