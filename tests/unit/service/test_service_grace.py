"""`service.workers.reaper.grace_end`: after the service could not hear its workers, a lease's end
(or a stall clock's) moves on by the time no reaper pass heard, and no further."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from service.workers.reaper import grace_end

NOW = datetime(2026, 12, 10, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=60)
INTERVAL = timedelta(seconds=5)


def end(deadline: datetime, heard_at: datetime | None) -> datetime:
    return grace_end(deadline, heard_at=heard_at, now=NOW, lease=LEASE, interval=INTERVAL)


def test_with_no_pass_on_record_a_lease_gets_one_lease_from_now() -> None:
    assert end(NOW - 3 * LEASE, heard_at=None) == NOW + LEASE
    assert end(NOW + 2 * LEASE, heard_at=None) == NOW + 2 * LEASE


def test_a_lease_moves_on_by_the_time_from_one_interval_after_the_last_pass() -> None:
    heard_at = NOW - 3 * LEASE
    deadline = heard_at + timedelta(seconds=40)  # 35 s left when the deafness began
    assert end(deadline, heard_at) == NOW + timedelta(seconds=35)


def test_a_lease_never_moves_past_one_lease_from_now_nor_back() -> None:
    heard_at = NOW - timedelta(seconds=30)
    # Renewed after the last pass (a report this replica took while its passes failed): 50 s
    # left, and 25 s unheard since one interval after that pass make 75 s, capped at 60 s.
    assert end(NOW + timedelta(seconds=50), heard_at) == NOW + LEASE
    assert end(NOW + 2 * LEASE, heard_at) == NOW + 2 * LEASE


def test_a_lease_that_ran_out_while_the_service_heard_stays_run_out() -> None:
    heard_at = NOW - 3 * LEASE
    assert end(heard_at - timedelta(seconds=1), heard_at) == heard_at - timedelta(seconds=1)
    assert end(heard_at + INTERVAL, heard_at) == heard_at + INTERVAL


def test_nothing_moves_when_a_pass_heard_within_the_last_interval() -> None:
    heard_at = NOW - INTERVAL
    assert end(NOW + timedelta(seconds=1), heard_at) == NOW + timedelta(seconds=1)
