"""A pass that runs in a background thread every `interval` seconds: the reaper and the outbox.

The first pass runs at once, so work left by a previous process (expired leases, unsent
messages) is taken up on startup. A pass that fails for any reason is logged and the thread
goes on: recovery and dispatch are only safe while their passes keep running.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Periodic:
    name = "periodic"

    def __init__(self, *, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> object:
        raise NotImplementedError

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name=f"trainctl-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while True:
            try:
                self.run_once()
            except Exception:
                log.exception("%s pass failed; retrying in %.1f s", self.name, self.interval)
            if self._stop.wait(self.interval):
                return
