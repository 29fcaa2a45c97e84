"""The placement decision on its own: order, quotas, gangs all or none, preemption rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from service.workers.scheduler import Active, Machine, Queued, decide

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def q(id: str, priority: int = 0, age: int = 0, owner: str = "a", devices: int = 1, nodes: int = 1):
    return Queued(id, f"run-{id}", priority, T0 + timedelta(seconds=age), owner, devices, nodes)


def running(id: str, workers: tuple[str, ...], priority: int = 0, at: int = 0, **kw) -> Active:
    return Active(
        id,
        f"run-{id}",
        priority,
        T0 + timedelta(seconds=at),
        kw.pop("owner", "a"),
        workers=workers,
        nodes=len(workers),
        **kw,
    )


def test_order_is_priority_then_age_and_one_worker_goes_to_the_first():
    d = decide(
        queued=[q("old", age=0), q("new", age=5), q("urgent", priority=5, age=9)],
        active=[],
        machines=[Machine("w1", 1)],
        quotas={},
    )
    assert [p.attempt_id for p in d.placements] == ["urgent"]
    assert [(w.attempt_id, w.position) for w in d.order] == [("urgent", 1), ("old", 2), ("new", 3)]
    assert "free up" in (d.reason("old") or "")


def test_quota_holds_and_does_not_block_others():
    d = decide(
        queued=[q("a1", age=0, owner="alice"), q("b1", age=1, owner="bob")],
        active=[running("a0", ("w0",), owner="alice")],
        machines=[Machine("w0", 1, busy=True), Machine("w1", 1)],
        quotas={"alice": 1},
    )
    assert [p.attempt_id for p in d.placements] == ["b1"]
    assert d.reason("a1") == "quota: owner alice uses 1 of 1 device and this attempt needs 1"


def test_gang_is_all_or_none_and_holds_no_worker():
    d = decide(
        queued=[q("g", nodes=2, age=0), q("small", age=1)],
        active=[running("r", ("w1",), priority=0)],
        machines=[Machine("w1", 1, busy=True), Machine("w2", 1)],
        quotas={},
    )
    # The gang cannot start (one free worker), holds none placed, and reserves w2 so the
    # small attempt behind it cannot starve it; equal priority preempts nothing.
    assert d.placements == []
    assert d.preemptions == []
    assert "gang needs 2 free workers" in (d.reason("g") or "")
    # Two gangs on three workers: the first takes two, the second waits for two.
    d = decide(
        queued=[q("g1", nodes=2, age=0), q("g2", nodes=2, age=1)],
        active=[],
        machines=[Machine("w1", 1), Machine("w2", 1), Machine("w3", 1)],
        quotas={},
    )
    assert [(p.attempt_id, p.workers) for p in d.placements] == [("g1", ("w1", "w2"))]


def test_no_preemption_of_equal_or_higher_priority():
    d = decide(
        queued=[q("x", priority=3)],
        active=[running("same", ("w1",), priority=3), running("higher", ("w2",), priority=7)],
        machines=[Machine("w1", 1, busy=True), Machine("w2", 1, busy=True)],
        quotas={},
    )
    assert d.preemptions == [] and d.placements == []


def test_preemption_picks_the_lowest_priority_then_the_newest():
    d = decide(
        queued=[q("hi", priority=10)],
        active=[
            running("low-old", ("w1",), priority=1, at=0),
            running("low-new", ("w2",), priority=1, at=50),
            running("mid", ("w3",), priority=5, at=99),
        ],
        machines=[Machine("w1", 1, True), Machine("w2", 1, True), Machine("w3", 1, True)],
        quotas={},
    )
    assert [(p.attempt_id, p.for_attempt) for p in d.preemptions] == [("low-new", "hi")]
    assert (d.reason("hi") or "").startswith("preempting low-new")
    # Next pass: the victim is yielding; nothing more is preempted while it does.
    d = decide(
        queued=[q("hi", priority=10)],
        active=[
            running("low-old", ("w1",), priority=1, at=0),
            running("low-new", ("w2",), priority=1, at=50, yielding=True),
        ],
        machines=[Machine("w1", 1, True), Machine("w2", 1, True)],
        quotas={},
    )
    assert d.preemptions == []
    # A preemption that could not free enough workers is not made.
    d = decide(
        queued=[q("gang", priority=10, nodes=3)],
        active=[running("low", ("w1",), priority=1), running("top", ("w2",), priority=20)],
        machines=[Machine("w1", 1, True), Machine("w2", 1, True), Machine("w3", 1)],
        quotas={},
    )
    assert d.preemptions == [] and d.placements == []


def test_no_worker_big_enough_reserves_nothing():
    d = decide(
        queued=[q("big", devices=4, priority=9), q("small")],
        active=[],
        machines=[Machine("w1", 2)],
        quotas={},
    )
    assert [p.attempt_id for p in d.placements] == ["small"]
    assert (d.reason("big") or "").startswith("no worker big enough")


def test_smallest_sufficient_worker_is_taken_first():
    d = decide(
        queued=[q("one")], active=[], machines=[Machine("big", 4), Machine("small", 1)], quotas={}
    )
    assert d.placements[0].workers == ("small",)
