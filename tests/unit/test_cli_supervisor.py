"""The supervisor of `trainctl up`'s workers, on an injected clock with stand-in children."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from itertools import count

import pytest

from cli.stack import Backoff, Supervisor, describe_exit


class FakeChild:
    """A child that runs until `exit(code)`; what Popen's poll() answers then."""

    pids = count(100)

    def __init__(self, index: int) -> None:
        self.index, self.pid = index, next(self.pids)
        self.code: int | None = None
        self.stopped = False

    def poll(self) -> int | None:
        return self.code

    def exit(self, code: int) -> None:
        self.code = code


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def supervise(
    clock: Clock,
    workers: int = 1,
    backoff: Backoff = Backoff(first=1.0, cap=8.0, healthy_after=30.0),
    on_restart: Callable[[], None] = lambda: None,
) -> tuple[Supervisor[FakeChild], list[FakeChild]]:
    started: list[FakeChild] = []

    def start(index: int) -> FakeChild:
        started.append(FakeChild(index))
        return started[-1]

    def stop(child: FakeChild) -> None:
        child.stopped = True

    supervisor = Supervisor(
        start, workers, stop_child=stop, backoff=backoff, clock=clock, on_restart=on_restart
    )
    return supervisor, started


def restart_delays(supervisor: Supervisor[FakeChild], clock: Clock, deaths: int) -> list[float]:
    """Kill the only child `deaths` times at once after each start; the pause before each
    restart, measured by stepping the clock by 0.25 s."""
    delays = []
    for _ in range(deaths):
        child = supervisor.children[0]
        child.exit(-signal.SIGKILL)
        supervisor.poll()
        died = clock.now
        while supervisor.children[0] is child:
            clock.now += 0.25
            supervisor.poll()
        delays.append(clock.now - died)
    return delays


def test_a_worker_that_keeps_dying_is_restarted_after_doubling_pauses_up_to_the_cap() -> None:
    clock = Clock()
    supervisor, started = supervise(clock)
    assert restart_delays(supervisor, clock, 6) == [1, 2, 4, 8, 8, 8]
    assert supervisor.restarts == 6 and len(started) == 7


def test_a_worker_that_ran_healthily_is_restarted_after_the_first_pause_again() -> None:
    clock = Clock()
    supervisor, _ = supervise(clock)
    assert restart_delays(supervisor, clock, 3) == [1, 2, 4]
    clock.now += 30  # the restarted worker runs for `healthy_after`
    assert restart_delays(supervisor, clock, 2) == [1, 2]


def test_each_exit_is_logged_with_its_signal_or_code_and_each_restart_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    counted: list[int] = []
    supervisor, started = supervise(clock, 2, on_restart=lambda: counted.append(1))
    first, second = supervisor.children
    caplog.set_level(logging.WARNING, logger="cli.stack")
    first.exit(-signal.SIGKILL)
    second.exit(3)
    supervisor.poll()
    assert f"worker 0 (pid {first.pid}) exited with signal SIGKILL" in caplog.text
    assert f"worker 1 (pid {second.pid}) exited with exit code 3" in caplog.text
    clock.now += 1
    supervisor.poll()
    assert supervisor.children == started[2:] and [c.index for c in started[2:]] == [0, 1]
    assert supervisor.restarts == 2 and counted == [1, 1]
    assert f"worker 0 restarted as pid {started[2].pid}" in caplog.text


def test_close_stops_every_worker_and_restarts_none_after() -> None:
    clock = Clock()
    supervisor, started = supervise(clock, workers=2)
    started[0].exit(-signal.SIGTERM)
    supervisor.poll()
    supervisor.close()
    assert all(child.stopped for child in started)
    clock.now += 100
    supervisor.poll()
    assert len(started) == 2 and supervisor.restarts == 0


def test_watch_restarts_a_dead_worker_from_its_thread() -> None:
    restarted = threading.Event()
    supervisor, started = supervise(Clock(), backoff=Backoff(first=0.0), on_restart=restarted.set)
    supervisor.watch(interval=0.01)
    try:
        started[0].exit(1)
        assert restarted.wait(timeout=10)
        assert supervisor.restarts == 1 and supervisor.children == [started[1]]
    finally:
        supervisor.close()


def test_exits_are_described_by_code_or_signal_name() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-200) == "signal 200"
