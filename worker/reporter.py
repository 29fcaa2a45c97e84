"""What the training loop tells the outside world, and how it learns it must pause or stop.

The loop calls a `Reporter`; `ServiceReporter` posts to the service, tests use a recorder.
Heartbeats are sent from the loop itself: a step that takes longer than the lease would let
the lease expire, so heartbeat_seconds must stay well under lease_seconds. Work that reports
nothing for long (preparing a phase: hashing, reading and encoding data, loading a checkpoint;
evaluating) runs inside `keepalive`, which heartbeats from a thread meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Literal, Protocol

from contracts.reports import (
    MAX_POINTS_PER_BATCH,
    CheckpointRef,
    CheckpointReport,
    Claim,
    EvalBatch,
    EvalResult,
    Finish,
    Heartbeat,
    MetricBatch,
    MetricPoint,
)
from worker.client import ServiceClient, ServiceError, ServiceUnavailable, Superseded
from worker.spool import Report, Spool, SpoolError, kind_of

log = logging.getLogger(__name__)

# The service's orders, from a heartbeat answer: train on; checkpoint now and finish "paused";
# stop at once and write nothing more (the attempt was superseded or the run cancelled).
Action = Literal["continue", "pause", "stop"]


class Reporter(Protocol):
    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Record one step's metrics (may be buffered)."""

    def evals(self, results: Sequence[EvalResult]) -> None: ...

    def checkpoint(self, ref: CheckpointRef) -> bool:
        """Register a checkpoint; called only once it is complete on disk. True when the service
        now holds it; False when the registration is still queued."""

    def check(self, step: int, *, now: bool = False) -> Action:
        """Renew the lease when due, or at once with `now` (the fencing check before a
        checkpoint is put in place), and return the service's order. A service that cannot be
        reached orders nothing: "continue"."""

    def keepalive(self, step: int) -> AbstractContextManager[None]:
        """Keep the lease while the caller works without reporting, at `step` (the last step
        done); an order received meanwhile is returned by the next `check`. The caller makes
        no other call on the reporter inside it."""


class ServiceReporter:
    """Posts to the service in order, batching metric points, and heartbeats every
    `heartbeat_seconds`.

    Training outlives a service outage: a report the service cannot take (unreachable, or 5xx
    through the client's retries) goes to the attempt's spool on disk (`worker.spool`), and so
    does every later one until the spool is sent, oldest first, at the next heartbeat that finds
    the service back. A failed heartbeat is only logged (if the lease lapses meanwhile, the
    service supersedes this attempt and says so on the next request that gets through).

    A "stop" answer or a 409 `superseded` on any report ends all reporting: the spool is
    dropped and every later call is a no-op; a 409 also raises `worker.client.Superseded`,
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
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client = client
        self._attempt_id = claim.attempt_id
        self._token = claim.fencing_token
        self._spool = Spool(spool_dir / claim.attempt_id)
        self._heartbeat_seconds = heartbeat_seconds
        self._flush_seconds = flush_seconds
        self._clock = clock
        self._sleep = sleep
        # The claim itself renewed the lease.
        self._last_beat = clock()
        self._points: list[MetricPoint] = []
        self._stopped = False
        # An order a keepalive heartbeat received, for the loop's next `check`.
        self._pending: Action | None = None
        self.last_step: int | None = None  # the last step whose metrics were recorded

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        if self._stopped:
            return
        self.last_step = step
        self._points.extend(MetricPoint(name=k, step=step, value=v) for k, v in values.items())
        if len(self._points) >= MAX_POINTS_PER_BATCH:
            self._submit([])

    def evals(self, results: Sequence[EvalResult]) -> None:
        if results and not self._stopped:
            self._submit([EvalBatch(fencing_token=self._token, results=list(results))])

    def checkpoint(self, ref: CheckpointRef) -> bool:
        # Sent behind the metrics: the service never holds a checkpoint newer than its metrics.
        if self._stopped:
            return False
        return self._submit([CheckpointReport(fencing_token=self._token, checkpoint=ref)])

    def check(self, step: int, *, now: bool = False) -> Action:
        action = self._heartbeat(step, now=now)
        if action == "continue" and self._pending is not None:
            action, self._pending = self._pending, None
        return action

    def _heartbeat(self, step: int, *, now: bool = False) -> Action:
        """Renew the lease when due (or `now`) and return the service's order."""
        if self._stopped:
            return "stop"
        beat = self._clock()
        if not now and beat - self._last_beat < self._heartbeat_seconds:
            return "continue"
        self._last_beat = beat
        # The spool and the buffered points first; a service that cannot take them would not
        # answer the heartbeat either, and each try costs the client's retries.
        if not (self._deliver() and self._submit([])):
            log.warning("heartbeat at step %d skipped: the service is unreachable", step)
            return "continue"
        try:
            answer = self._client.heartbeat(
                self._attempt_id, Heartbeat(fencing_token=self._token, step=step)
            )
        except ServiceUnavailable as err:
            log.warning("heartbeat at step %d failed; training on: %s", step, err)
            return "continue"
        except Superseded:
            answer_action: Action = "stop"
        else:
            answer_action = answer.action
        if answer_action == "stop":
            self._stop()
        return answer_action

    @contextmanager
    def keepalive(self, step: int) -> Iterator[None]:
        """Heartbeat from a thread, when due, while the caller works without reporting. The
        thread is the only user of this reporter meanwhile (see Reporter.keepalive). A pause
        order is kept for the loop and the lease still renewed; after a stop there is nothing
        left to keep."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(max(self._heartbeat_seconds, 0.5)):
                try:
                    action = self._heartbeat(step)
                except Exception:  # a refused report, say: the loop learns of it when it checks
                    log.exception("keepalive heartbeat at step %d failed", step)
                    continue
                if action == "stop":
                    return
                if action == "pause":
                    self._pending = "pause"

        thread = threading.Thread(target=beat, name=f"keepalive-{self._attempt_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

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
        """Let go of the spool (what is left in it stays on disk for `drain_spools`)."""
        self._spool.release()

    # --- delivery --------------------------------------------------------------------------

    def _submit(self, reports: list[Report]) -> bool:
        """Send the buffered points, then `reports`, behind anything spooled; what the service
        cannot take is spooled. True when all of it was delivered."""
        points, self._points = self._points, []
        batches: list[Report] = [
            MetricBatch(fencing_token=self._token, points=points[i : i + MAX_POINTS_PER_BATCH])
            for i in range(0, len(points), MAX_POINTS_PER_BATCH)
        ]
        delivered = not self._spool.entries()
        for report in [*batches, *reports]:
            if delivered:
                try:
                    self._send(report)
                    continue
                except ServiceUnavailable as err:
                    log.warning("service unreachable; spooling reports from now on: %s", err)
                    delivered = False
            self._spool.append(report)
        return delivered

    def _deliver(self) -> bool:
        """Send the spool, oldest first; False when the service is unreachable (the rest stays
        spooled for the next try)."""
        for path in self._spool.entries():
            try:
                self._send(self._spool.read(path))
            except ServiceUnavailable as err:
                left = len(self._spool.entries())
                log.warning("service unreachable; %d reports stay spooled: %s", left, err)
                return False
            self._spool.remove(path)
        return True

    def _send(self, report: Report) -> None:
        try:
            send_report(self._client, self._attempt_id, report)
        except Superseded:
            self._stop()
            raise

    def _stop(self) -> None:
        """The attempt is no longer ours: report nothing more, drop what is spooled."""
        self._stopped = True
        self._points = []
        self._spool.discard()


def send_report(client: ServiceClient, attempt_id: str, report: Report) -> None:
    """Post one report. Points the service refuses are logged, one line each; they are not
    retried (they would be refused again) and do not stop training."""
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
        client.checkpoint(attempt_id, report)
    else:
        client.finish(attempt_id, report)


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
