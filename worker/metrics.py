"""The worker's Prometheus metrics, served on `TRAINCTL_METRICS_PORT` when it is set."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

STEPS = Counter("trainctl_worker_steps", "Optimizer steps taken by this worker process.")
TOKENS = Counter(
    "trainctl_worker_tokens", "Envelope tokens processed by this worker process (all steps)."
)
STEP_SECONDS = Histogram(
    "trainctl_worker_step_seconds",
    "Wall time of one optimizer step (forward, backward, optimizer).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CURRENT_STEP = Gauge("trainctl_worker_step", "The global step of the attempt being trained.")
CHECKPOINTS = Counter("trainctl_worker_checkpoints", "Checkpoints published by this worker.")
ATTEMPTS = Counter(
    "trainctl_worker_attempts", "Attempts this worker ended, by how they ended.", ["status"]
)
SPOOLED = Counter(
    "trainctl_worker_reports_spooled",
    "Reports written to the spool because the service could not take them.",
)
UNSPOOLED = Counter(
    "trainctl_worker_reports_unspooled",
    "Spooled reports the service took later (sent by the attempt's own process).",
)
JOBS = Counter("trainctl_worker_jobs", "Jobs (inspections, evaluations) run, by kind.", ["kind"])


def serve(port: int) -> None:
    """Serve GET /metrics on `port` from a daemon thread."""
    start_http_server(port)
    log.info("worker metrics on :%d/metrics", port)


def observe_step(step: int, seconds: float, tokens: int) -> None:
    STEPS.inc()
    TOKENS.inc(tokens)
    STEP_SECONDS.observe(seconds)
    CURRENT_STEP.set(step)
