"""What the training loop tells the outside world, and the one way it learns it must stop.

The loop calls a `Reporter`; `ServiceReporter` posts to the service, tests use a recorder.
Heartbeats are sent from the loop itself (no thread): a step that takes longer than the lease
would let the lease expire, so heartbeat_seconds must stay well under lease_seconds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from contracts.reports import (
    MAX_POINTS_PER_BATCH,
    CheckpointRef,
    CheckpointReport,
    Claim,
    EvalBatch,
    EvalResult,
    Heartbeat,
    MetricPoint,
)
from worker.client import ServiceClient, ServiceUnavailable

log = logging.getLogger(__name__)


class Reporter(Protocol):
    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Record one step's metrics (may be buffered)."""

    def evals(self, results: Sequence[EvalResult]) -> None: ...

    def checkpoint(self, ref: CheckpointRef) -> bool:
        """Register a checkpoint; called only once it is complete on disk. True when the service
        now holds it; False when the registration is still queued."""

    def should_stop(self, step: int) -> bool:
        """Renew the lease when due; True when the service says stop (write nothing more)."""


# What is waiting to be posted, in order: metric points, an eval batch, a checkpoint report.
_Pending = list[MetricPoint] | EvalBatch | CheckpointReport


class ServiceReporter:
    """Posts to the service in order, batching metric points, and heartbeats every
    `heartbeat_seconds`.

    Training outlives a service restart: a post that finds the service unavailable stays queued
    (in memory) and is retried at the next heartbeat, and a failed heartbeat is only logged (if
    the lease lapses meanwhile, the service supersedes this attempt and says so with 409 on the
    next post that gets through). Any post may raise `worker.client.Superseded`, which the
    runner turns into a silent stop. `flush` raises `ServiceUnavailable` if anything is still
    undelivered, so an attempt never finishes ahead of its own reports."""

    def __init__(
        self,
        client: ServiceClient,
        claim: Claim,
        *,
        heartbeat_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._attempt_id = claim.attempt_id
        self._token = claim.fencing_token
        self._heartbeat_seconds = heartbeat_seconds
        self._clock = clock
        # The claim itself renewed the lease.
        self._last_beat = clock()
        self._points: list[MetricPoint] = []
        self._pending: deque[_Pending] = deque()
        self.last_step: int | None = None  # the last step whose metrics were recorded

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.last_step = step
        self._points.extend(MetricPoint(name=k, step=step, value=v) for k, v in values.items())
        if len(self._points) >= MAX_POINTS_PER_BATCH:
            self._deliver()

    def evals(self, results: Sequence[EvalResult]) -> None:
        if results:
            self._queue(EvalBatch(fencing_token=self._token, results=list(results)))
            self._deliver()

    def checkpoint(self, ref: CheckpointRef) -> bool:
        # Queued behind the metrics: the service never holds a checkpoint newer than its metrics.
        self._queue(CheckpointReport(fencing_token=self._token, checkpoint=ref))
        return self._deliver()

    def should_stop(self, step: int) -> bool:
        now = self._clock()
        if now - self._last_beat < self._heartbeat_seconds:
            return False
        self._last_beat = now
        self._deliver()
        try:
            answer = self._client.heartbeat(
                self._attempt_id, Heartbeat(fencing_token=self._token, step=step)
            )
        except ServiceUnavailable as err:
            log.warning("heartbeat at step %d failed; training on: %s", step, err)
            return False
        return answer.action == "stop"

    def flush(self) -> None:
        if not self._deliver():
            raise ServiceUnavailable(
                f"{len(self._pending)} reports of attempt {self._attempt_id} are undelivered: "
                "the service is unavailable"
            )

    def _queue(self, item: _Pending) -> None:
        if self._points:
            self._queue_points()
        self._pending.append(item)

    def _deliver(self) -> bool:
        """Post what is queued, in order; False when the service is unavailable (the rest stays
        queued for the next try)."""
        if self._points:
            self._queue_points()
        while self._pending:
            item = self._pending[0]
            try:
                if isinstance(item, EvalBatch):
                    self._client.evals(self._attempt_id, item)
                elif isinstance(item, CheckpointReport):
                    self._client.checkpoint(self._attempt_id, item)
                else:
                    self._client.metrics(self._attempt_id, fencing_token=self._token, points=item)
            except ServiceUnavailable as err:
                log.warning("service unavailable; %d reports queued: %s", len(self._pending), err)
                return False
            self._pending.popleft()
        return True

    def _queue_points(self) -> None:
        self._pending.append(self._points)
        self._points = []
