"""What the training loop tells the outside world, and how it learns it must pause or stop.

The loop calls a `Reporter`; `ServiceReporter` posts to the service, tests use a recorder.
The lease is not the loop's business: a `worker.link.lease.LeaseKeeper` thread renews it from claim
to finish, however long a step, a checkpoint wait or a preparation takes. What the loop owes
the lease is progress: every report moves the keeper's counter, and work that reports nothing
for long (preparing a phase, evaluating) calls `progress()` as it goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from contracts.reports import (
    MAX_POINTS_PER_BATCH,
    MAX_REMOVAL_REASON,
    Accepted,
    CheckpointRef,
    CheckpointRegistered,
    CheckpointRemoval,
    CheckpointReport,
    Claim,
    EvalBatch,
    EvalResult,
    Finish,
    MetricBatch,
    MetricPoint,
    RemovalStatus,
    metric_batches,
)
from worker import metrics
from worker.link.client import ServiceClient, ServiceError, ServiceUnavailable, Superseded
from worker.link.lease import Action, LeaseKeeper
from worker.link.spool import Report, Spool, SpoolError, kind_of, spool_name

log = logging.getLogger(__name__)

__all__ = ["Action", "Reporter", "ServiceReporter", "SilentReporter", "drain_spools", "send_report"]


class Reporter(Protocol):
    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Record one step's metrics (may be buffered)."""

    def evals(self, results: Sequence[EvalResult]) -> None: ...

    def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
        """Register a checkpoint; called only once it is complete on disk. None while the
        registration is still queued; once the service holds it, the run's pinned steps from
        its answer (checkpoints another run still needs as its initial weights: it has not
        succeeded and has no checkpoint of its own; retention keeps them)."""

    def checkpoint_removed(self, step: int, status: RemovalStatus, reason: str) -> bool:
        """Report that this run's checkpoint at `step` is to be deleted (retention) or was
        quarantined (failed verification); queued like every report. True once the service
        recorded it; False when it is still queued or was refused (the checkpoint is pinned:
        logged, not raised). Retention deletes only on True."""

    def check(self, step: int, *, now: bool = False) -> Action:
        """The service's latest order, as the lease keeper last heard it; with `now`, ask the
        service at once (the fencing check before a checkpoint is put in place). A service
        that cannot be reached orders nothing new."""

    def progress(self) -> None:
        """A unit of work that reports nothing else was done (preparation, an eval set): the
        lease keeper's next heartbeat says the worker is not hung."""

    def preparing(self, file: str, fraction: float) -> None:
        """`file` is being tokenized into its store, `fraction` of it read (1.0: done); the
        run shows it until the first step."""


class SilentReporter:
    """The reporter of a rank other than 0 on a phase of many devices: rank 0 speaks for all
    (worker.train.ranks), so everything here is dropped and no order ever comes."""

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def evals(self, results: Sequence[EvalResult]) -> None:
        pass

    def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
        return None

    def checkpoint_removed(self, step: int, status: RemovalStatus, reason: str) -> bool:
        return False

    def check(self, step: int, *, now: bool = False) -> Action:
        return "continue"

    def progress(self) -> None:
        pass

    def preparing(self, file: str, fraction: float) -> None:
        pass


class ServiceReporter:
    """Posts to the service in order, batching metric points (sent at least every
    `heartbeat_seconds`), and owns the attempt's `LeaseKeeper` (`start`, and `close` stops it).

    Training outlives a service outage: a report the service cannot take (unreachable, or 5xx
    through the client's retries) goes to the attempt's spool on disk (`worker.link.spool`), and so
    does every later one until the spool is sent, oldest first, at the next `check` that finds
    the service back. A failed heartbeat is only logged (if the lease lapses meanwhile, the
    service supersedes this attempt and says so on the next request that gets through).

    A "stop" answer or a 409 `superseded` on any report ends all reporting: the spool is
    dropped and every later call is a no-op; a 409 also raises `worker.link.client.Superseded`,
    which the runner turns into a silent stop. `finish` sends the rest and the finish, waiting
    up to `flush_seconds` for an unreachable service."""

    def __init__(
        self,
        client: ServiceClient,
        claim: Claim,
        *,
        spool_dir: Path,
        heartbeat_seconds: float,
        flush_seconds: float = 300.0,
        abandon_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client = client
        self._attempt_id = claim.attempt_id
        self._token = claim.fencing_token
        self._spool = Spool(spool_dir / spool_name(claim.attempt_id, claim.node_rank))
        self._heartbeat_seconds = heartbeat_seconds
        self._flush_seconds = flush_seconds
        self._clock = clock
        self._sleep = sleep
        self._last_flush = clock()
        self._points: list[MetricPoint] = []
        self._stopped = False
        start = claim.resume_from.step if claim.resume_from is not None else 0
        self.lease = LeaseKeeper(
            client,
            attempt_id=claim.attempt_id,
            fencing_token=claim.fencing_token,
            # Three tries per lease whatever this worker was configured with: a service whose
            # lease is shorter than our heartbeat would otherwise reap every attempt.
            interval=min(heartbeat_seconds, claim.lease_seconds / 3),
            step=start,
            abandon_seconds=abandon_seconds,
            member=claim.node_rank,
        )
        self.last_step: int | None = None  # the last step whose metrics were recorded
        # The pinned steps of the last checkpoint registration delivered.
        self._pinned: frozenset[int] | None = None
        self._recorded = False  # whether the service recorded the last report delivered

    def start(self) -> None:
        """Start renewing the lease (from one thread, until `close`)."""
        self.lease.start()

    def progress(self) -> None:
        self.lease.advance()

    def preparing(self, file: str, fraction: float) -> None:
        self.lease.preparing(file, fraction)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        if self._stopped:
            return
        self.last_step = step
        self.lease.advance(step)
        self._points.extend(MetricPoint(name=k, step=step, value=v) for k, v in values.items())
        if len(self._points) >= MAX_POINTS_PER_BATCH:
            self._submit([])

    def evals(self, results: Sequence[EvalResult]) -> None:
        self.lease.advance()
        if results and not self._stopped:
            self._submit([EvalBatch(fencing_token=self._token, results=list(results))])

    def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
        # Sent behind the metrics: the service never holds a checkpoint newer than its metrics.
        self.lease.advance()
        if self._stopped:
            return None
        self._pinned = None
        if not self._submit([CheckpointReport(fencing_token=self._token, checkpoint=ref)]):
            return None
        return self._pinned  # from this registration's answer (`_send`)

    def checkpoint_removed(self, step: int, status: RemovalStatus, reason: str) -> bool:
        self.lease.advance()
        if self._stopped:
            return False
        removal = CheckpointRemoval(
            fencing_token=self._token,
            step=step,
            status=status,
            reason=reason[:MAX_REMOVAL_REASON],
        )
        # Sent behind any buffered points: `_recorded` is then the removal's own answer.
        self._recorded = False
        return self._submit([removal]) and self._recorded

    def check(self, step: int, *, now: bool = False) -> Action:
        if self._stopped:
            return "stop"
        tick = self._clock()
        if not self.lease.reachable:
            # The keeper's heartbeats (in their own thread) probe the service; until one gets
            # through, trying here would only stall the loop for the client's retries.
            action = self.lease.order
        elif now or tick - self._last_flush >= self._heartbeat_seconds:
            self._last_flush = tick
            # The spool and the buffered points first; with `now`, a service that cannot take
            # them would not answer the fencing check either.
            delivered = self._deliver() and self._submit([])
            if not delivered:
                log.warning("reports at step %d stay spooled: the service is unreachable", step)
            if now and delivered:
                self.lease.advance(step)
                action = self.lease.beat()
            else:
                action = self.lease.order
        else:
            action = self.lease.order
        if action == "stop":
            self._stop()
        return action

    def finish(self, finish: Finish) -> None:
        """Send everything still buffered or spooled, then `finish`, in order. Waits up to
        `flush_seconds` for an unreachable service; then raises `ServiceUnavailable` with all
        of it left in the spool for the next worker process on this machine
        (`drain_spools`). Raises `Superseded` when the attempt is no longer ours."""
        self._submit([finish])
        deadline = self._clock() + self._flush_seconds
        while not self._deliver():
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise ServiceUnavailable(
                    f"{len(self._spool.entries())} reports of attempt {self._attempt_id}, the "
                    f"finish last, are spooled in {self._spool.directory}: the service stayed "
                    f"unreachable for {self._flush_seconds:g} s; the next worker process on "
                    "this machine sends them"
                )
            self._sleep(min(max(self._heartbeat_seconds, 1.0), remaining))

    def close(self) -> None:
        """Stop renewing the lease and let go of the spool (what is left in it stays on disk
        for `drain_spools`)."""
        self.lease.stop()
        self._spool.release()

    # --- delivery --------------------------------------------------------------------------

    def _submit(self, reports: list[Report]) -> bool:
        """Send the buffered points, then `reports`, behind anything spooled; what the service
        cannot take is spooled. True when all of it was delivered."""
        points, self._points = self._points, []
        batches: list[Report] = [
            MetricBatch(fencing_token=self._token, points=chunk) for chunk in metric_batches(points)
        ]
        # Behind anything spooled, and straight to the spool while the keeper cannot reach the
        # service: the loop never waits out the client's retries for a report.
        delivered = not self._spool.entries() and self.lease.reachable
        for report in [*batches, *reports]:
            if delivered:
                try:
                    self._send_or_drop(report)
                    continue
                except ServiceUnavailable as err:
                    log.warning("service unreachable; spooling reports from now on: %s", err)
                    self.lease.unreachable()
                    delivered = False
            self._spool.append(report)
            metrics.SPOOLED.inc()
        return delivered

    def _deliver(self) -> bool:
        """Send the spool, oldest first; False when the service is unreachable (the rest stays
        spooled for the next try)."""
        for path in self._spool.entries():
            try:
                self._send_or_drop(self._spool.read(path))
            except ServiceUnavailable as err:
                left = len(self._spool.entries())
                log.warning("service unreachable; %d reports stay spooled: %s", left, err)
                self.lease.unreachable()
                return False
            self._spool.remove(path)
            metrics.UNSPOOLED.inc()
        return True

    def _send_or_drop(self, report: Report) -> None:
        """Send `report`; one the service refuses for good (a 4xx other than `superseded`)
        is logged and dropped, never retried: it would be refused again and hold back every
        report behind it. A refused finish is raised: the runner decides what follows."""
        try:
            self._send(report)
        except (ServiceUnavailable, Superseded):
            raise
        except ServiceError as err:
            if isinstance(report, Finish):
                raise
            log.error(
                "attempt %s: the service refused a %s report; dropped: %s",
                self._attempt_id,
                kind_of(report),
                err,
            )

    def _send(self, report: Report) -> None:
        try:
            answer = send_report(self._client, self._attempt_id, report)
        except Superseded:
            self._stop()
            raise
        if isinstance(answer, CheckpointRegistered):
            self._pinned = frozenset(answer.pinned_steps)
        self._recorded = answer is not None

    def _stop(self) -> None:
        """The attempt is no longer ours: report nothing more, drop what is spooled."""
        self._stopped = True
        self._points = []
        self._spool.discard()


def send_report(
    client: ServiceClient, attempt_id: str, report: Report
) -> CheckpointRegistered | Accepted | None:
    """Post one report; the answer to a checkpoint registration, or to a removal the service
    recorded, is returned. Points the service refuses are logged, one line each, and so is a
    refused checkpoint removal (None); they are not retried (they would be refused again) and
    do not stop training."""
    if isinstance(report, MetricBatch):
        answer = client.metrics(
            attempt_id, fencing_token=report.fencing_token, points=report.points
        )
        for item in answer.errors:
            point = report.points[item.index] if 0 <= item.index < len(report.points) else None
            where = f"{point.name!r} at step {point.step}" if point else f"#{item.index}"
            log.warning(
                "attempt %s: the service refused metric point %s: %s",
                attempt_id,
                where,
                item.error,
            )
    elif isinstance(report, EvalBatch):
        client.evals(attempt_id, report)
    elif isinstance(report, CheckpointReport):
        return client.checkpoint(attempt_id, report)
    elif isinstance(report, CheckpointRemoval):
        try:
            return client.checkpoint_removed(attempt_id, report)
        except ServiceUnavailable:
            raise
        except ServiceError as err:
            # 409 `checkpoint_pinned`: a run started from it after this worker last heard the
            # pinned steps; the registry keeps it, and so does retention on disk
            # (worker.train.keeper.CheckpointKeeper).
            log.error(
                "attempt %s: the service refused the %s report of step %d: %s",
                attempt_id,
                report.status,
                report.step,
                err,
            )
    else:
        client.finish(attempt_id, report)
    return None


def drain_spools(client: ServiceClient, root: Path) -> None:
    """Send what earlier worker processes on this machine spooled and never sent (they died, or
    gave up waiting at a phase's end), oldest first per attempt. A report the service refuses
    (409 `superseded`: its fencing token is stale; any other 4xx) is dropped with a log line.
    A spool whose process still lives is left alone; when the service is unreachable the rest
    waits for the next start."""
    if not root.is_dir():
        return
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        spool = Spool(directory)
        if not spool.acquire(wait=False):
            continue
        try:
            for path in spool.entries():
                try:
                    report = spool.read(path)
                except SpoolError as err:
                    log.error("%s; set aside as %s", err, spool.set_aside(path))
                    continue
                try:
                    send_report(client, spool.attempt_id, report)
                except ServiceUnavailable as err:
                    log.warning("service unreachable; spooled reports wait: %s", err)
                    return
                except (Superseded, ServiceError) as err:
                    log.warning(
                        "dropping spooled %s report %s of attempt %s, refused: %s",
                        kind_of(report),
                        path.name,
                        spool.attempt_id,
                        err,
                    )
                else:
                    log.info(
                        "sent spooled %s report of attempt %s", kind_of(report), spool.attempt_id
                    )
                spool.remove(path)
        finally:
            spool.release()
