"""The lease keeper: one daemon thread that renews an attempt's lease from claim to finish,
whatever the training loop is doing (a step, a checkpoint wait, an evaluation, hashing or
encoding inputs may each take longer than the lease).

A thread alone would keep a hung worker's lease forever, so every heartbeat carries
`progress`, a counter the loop moves as it works (`advance`: a step, an eval, a checkpoint, a
unit of preparation). The service judges a stall by that counter, not by the heartbeats: an
attempt whose progress has not moved for TRAINCTL_STALL_SECONDS is lost with cause `stalled`
even while its keeper still beats.

The keeper only heartbeats; it never touches the reporter's spool. It keeps the service's
latest order (`continue`, `pause`, or `stop`: stop and pause stick) for the loop to read.

A hung worker is not a live one: when the service says `stop` (the attempt was lost as
stalled, or given away) and the attempt has not ended `abandon_seconds` later, the training
thread is stuck for good, and the keeper ends the process (exit code 70, EXIT_HUNG), so that
its supervisor starts a fresh one and the machine takes work again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Literal

from contracts.reports import Heartbeat, Preparing
from worker.link.client import ServiceClient, ServiceError, ServiceUnavailable, Superseded

log = logging.getLogger(__name__)

# The service's orders, from a heartbeat answer: train on; checkpoint now and finish "paused";
# stop at once and write nothing more (the attempt was superseded or the run cancelled).
Action = Literal["continue", "pause", "stop"]

# The exit code of a process that ended itself because its training thread hung.
EXIT_HUNG = 70


class LeaseKeeper:
    def __init__(
        self,
        client: ServiceClient,
        *,
        attempt_id: str,
        fencing_token: str,
        interval: float,
        step: int,
        abandon_seconds: float | None = None,
        exit: Callable[[int], object] = os._exit,
        member: int = 0,
    ) -> None:
        self._client = client
        # Across many workers, each member keeps its own lease: its heartbeats say which it is.
        self._member = member
        self._attempt_id = attempt_id
        self._token = fencing_token
        self._interval = interval
        self._abandon_seconds = abandon_seconds
        self._exit = exit
        self._lock = threading.Lock()  # guards the fields below
        self._beat_lock = threading.Lock()  # one heartbeat in flight at a time
        self._step = step
        self._progress = 0
        self._preparing: Preparing | None = None
        self._order: Action = "continue"
        self._reachable = True  # whether the last heartbeat got an answer
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def order(self) -> Action:
        with self._lock:
            return self._order

    @property
    def reachable(self) -> bool:
        """The last heartbeat got an answer (the service is up, as far as the keeper knows)."""
        with self._lock:
            return self._reachable

    def unreachable(self) -> None:
        """Another request found the service unreachable: take it as the keeper's own failed
        beat (the next beat that gets an answer says otherwise)."""
        with self._lock:
            self._reachable = False

    @property
    def progress(self) -> int:
        with self._lock:
            return self._progress

    def advance(self, step: int | None = None) -> None:
        """The loop did a unit of work (at `step`, the last global step done, when given).
        A step ends any preparation."""
        with self._lock:
            self._progress += 1
            if step is not None:
                self._step = step
                self._preparing = None

    def preparing(self, file: str, fraction: float) -> None:
        """`file` is being tokenized into its store, `fraction` of it read so far (1.0: done;
        the next heartbeats stop saying so)."""
        with self._lock:
            self._progress += 1
            self._preparing = None if fraction >= 1.0 else Preparing(file=file, fraction=fraction)

    def beat(self) -> Action:
        """One heartbeat now; returns the service's order (the previous one when the service
        cannot be reached: an unreachable service orders nothing)."""
        with self._beat_lock:
            with self._lock:
                report = Heartbeat(
                    fencing_token=self._token,
                    step=self._step,
                    progress=self._progress,
                    preparing=self._preparing,
                    member=self._member,
                )
            try:
                answer = self._client.heartbeat(self._attempt_id, report)
            except ServiceUnavailable as err:
                log.warning("heartbeat at step %d failed; training on: %s", report.step, err)
                with self._lock:
                    self._reachable = False
                    return self._order
            except Superseded:
                action: Action = "stop"
            except ServiceError as err:  # a 4xx other than superseded: say so, keep trying
                log.error("heartbeat at step %d refused: %s", report.step, err)
                with self._lock:
                    self._reachable = True
                    return self._order
            else:
                action = answer.action
            with self._lock:
                self._reachable = True
                if self._order == "continue" or action == "stop":
                    self._order = action
                return self._order

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"lease-{self._attempt_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            try:
                if self.beat() == "stop":
                    break  # nothing left to keep
            except Exception:  # an unexpected answer: logged, and the next beat still goes out
                log.exception("heartbeat of attempt %s failed", self._attempt_id)
        else:
            return  # stopped by the attempt's end
        if self._abandon_seconds is not None:
            # The keeper's work is done; a watchdog waits for the attempt to end.
            threading.Thread(
                target=self._watch_for_the_end, name=f"abandon-{self._attempt_id}", daemon=True
            ).start()

    def _watch_for_the_end(self) -> None:
        assert self._abandon_seconds is not None
        if not self._done.wait(self._abandon_seconds):
            log.critical(
                "attempt %s was told to stop %.0f s ago and has not: its training thread "
                "hangs; ending this process (exit %d) so that a fresh one takes work",
                self._attempt_id,
                self._abandon_seconds,
                EXIT_HUNG,
            )
            self._exit(EXIT_HUNG)
