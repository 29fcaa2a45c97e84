"""Placement: which queued attempt runs on which live workers, and which running ones yield.

`decide` is a pure function over plain data (no database, no clock), so its rules are tested
on their own (tests/unit/service/test_scheduler.py); `service.workers.placement` runs it under a
database lock and writes what it decided.

The rules, in order:
- Queued attempts are taken highest priority first, then oldest (`queued_at`), then by id.
- An attempt needs `nodes` distinct live workers that each own at least `devices` devices and
  run nothing: all of them at once or none (a gang never holds half its workers). Among the
  free workers big enough, the smallest are taken first (a big worker stays for a big phase).
- An owner's quota (`max_devices`, None: unlimited) caps the devices (nodes x devices) of its
  attempts placed or running at once; an attempt that would pass it waits, and does not hold
  up the attempts behind it.
- An attempt that fits the fleet but finds too few free workers reserves the free ones it could
  use: attempts behind it may not take them (strict priority; a two-node phase is not starved
  by one-node phases slipping onto each worker as it frees). It may preempt: running attempts
  of strictly lower priority on workers it could use are told to yield, lowest priority first,
  then the most recently placed, until enough workers would be free; never an equal or higher
  priority, and only when yielding them is enough. Attempts already yielding count as freeing.
- An attempt no live worker (or too few) could ever run waits with that reason and reserves
  nothing.

Costs: O(queued x workers log workers); with 100 queued attempts and a few dozen workers well
under a millisecond (bench/placement.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class Queued:
    """A queued attempt not yet placed."""

    id: str
    run_id: str
    priority: int
    queued_at: datetime
    owner: str | None
    devices: int = 1
    nodes: int = 1

    @property
    def total(self) -> int:
        return self.devices * self.nodes


@dataclass(frozen=True)
class Active:
    """An attempt placed (not claimed yet) or running, on `workers` (keys; empty when the
    service does not know where it runs: a claim from outside placement)."""

    id: str
    run_id: str
    priority: int
    placed_at: datetime
    owner: str | None
    devices: int = 1
    nodes: int = 1
    workers: tuple[str, ...] = ()
    yielding: bool = False
    # Claimed by its worker(s); a placed attempt not claimed yet is never preempted (it would
    # only start to be told to stop).
    running: bool = True

    @property
    def total(self) -> int:
        return self.devices * self.nodes


@dataclass(frozen=True)
class Machine:
    """A live worker that has its own queue: its key, the devices it owns, and whether it runs
    (or was given) an attempt."""

    key: str
    devices: int
    busy: bool = False


@dataclass(frozen=True)
class Placement:
    attempt_id: str
    workers: tuple[str, ...]  # member k runs on workers[k]


@dataclass(frozen=True)
class Preemption:
    attempt_id: str  # the running attempt told to yield
    run_id: str
    for_attempt: str  # the queued attempt it makes room for


@dataclass(frozen=True)
class Waiting:
    attempt_id: str
    position: int  # 1-based, in placement order
    reason: str


@dataclass
class Decision:
    placements: list[Placement] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    # Every queued attempt, in placement order, with its position and why it waits (the
    # placed ones too, with reason "placed").
    order: list[Waiting] = field(default_factory=list)

    def reason(self, attempt_id: str) -> str | None:
        return next((w.reason for w in self.order if w.attempt_id == attempt_id), None)


def placement_order(queued: Iterable[Queued]) -> list[Queued]:
    """Highest priority first, then the oldest, then by id (a total order)."""
    return sorted(queued, key=lambda q: (-q.priority, q.queued_at, q.id))


def _devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def decide(
    *,
    queued: Sequence[Queued],
    active: Sequence[Active],
    machines: Sequence[Machine],
    quotas: Mapping[str, int | None],
) -> Decision:
    """What to place and whom to preempt now (see the module docstring). `quotas` maps an
    owner to its max_devices (absent or None: unlimited)."""
    decision = Decision()
    free = {m.key: m.devices for m in machines if not m.busy}
    size = {m.key: m.devices for m in machines}
    use: dict[str | None, int] = {}
    for a in active:
        use[a.owner] = use.get(a.owner, 0) + a.total
    # Running attempts that may be asked to yield: on known workers, not yielding yet.
    victims = [a for a in active if a.workers and not a.yielding and a.running]
    yielding = [a for a in active if a.workers and a.yielding]
    reserved: set[str] = set()
    blocked_ahead = 0
    for position, q in enumerate(placement_order(queued), start=1):

        def wait(reason: str, q: Queued = q, position: int = position) -> None:
            decision.order.append(Waiting(q.id, position, reason))

        fits = sorted(k for k, d in size.items() if d >= q.devices)
        if len(fits) < q.nodes:
            largest = max(size.values(), default=0)
            wait(
                f"no worker big enough: needs {_workers(q.nodes)} with {_devices(q.devices)} "
                f"each; {len(fits)} live worker(s) own that many (the largest owns "
                f"{_devices(largest)})"
                if machines
                else "no live worker: start one (trainctl worker)"
            )
            continue
        limit = quotas.get(q.owner) if q.owner is not None else None
        used = use.get(q.owner, 0)
        if limit is not None and used + q.total > limit:
            wait(
                f"quota: owner {q.owner} uses {used} of {_devices(limit)} and this attempt "
                f"needs {q.total}"
            )
            continue
        usable = sorted(
            (k for k in fits if k in free and k not in reserved), key=lambda k: (free[k], k)
        )
        if len(usable) >= q.nodes:
            chosen = tuple(usable[: q.nodes])
            for k in chosen:
                del free[k]
            use[q.owner] = used + q.total
            decision.placements.append(Placement(q.id, chosen))
            wait("placed")
            continue
        # Blocked for free workers: hold the ones it could use, and maybe make room.
        reserved.update(usable)
        missing = q.nodes - len(usable)
        fit = set(fits)
        coming = [a for a in yielding if any(k in fit for k in a.workers)]
        freeing = {k for a in coming for k in a.workers if k in fit}
        ahead = f"; behind {blocked_ahead} higher attempt(s) waiting" if blocked_ahead else ""
        blocked_ahead += 1
        if len(freeing) >= missing:
            reserved.update(freeing)
            yielding = [a for a in yielding if a not in coming]
            names = ", ".join(a.id for a in coming)
            wait(f"preempting {names}: waiting for it to checkpoint and yield{ahead}")
            continue
        lower = [
            a
            for a in victims
            if a.priority < q.priority and any(k in fit and k not in reserved for k in a.workers)
        ]
        lower.sort(key=lambda a: (a.priority, -a.placed_at.timestamp(), a.id))
        chosen_victims: list[Active] = []
        gained = set(freeing)
        for a in lower:
            if len(gained) >= missing:
                break
            chosen_victims.append(a)
            gained.update(k for k in a.workers if k in fit and k not in reserved)
        if len(gained) >= missing and chosen_victims:
            reserved.update(gained)
            for a in chosen_victims:
                victims.remove(a)
                decision.preemptions.append(Preemption(a.id, a.run_id, q.id))
            names = ", ".join(a.id for a in chosen_victims)
            wait(f"preempting {names} (lower priority){ahead}")
            continue
        if q.nodes > 1:
            wait(
                f"gang needs {q.nodes} free workers with {_devices(q.devices)} each; "
                f"{len(usable)} free{ahead}"
            )
        else:
            wait(f"waiting for a worker with {_devices(q.devices)} to free up{ahead}")
    return decision
