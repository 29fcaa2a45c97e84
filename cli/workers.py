"""`trainctl workers`: the workers the service has heard from, what they own and run."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import JsonOpt, call, console, jsonable


def workers_list(as_json: JsonOpt = False) -> None:
    """List the workers the service has heard from, most recent first; a worker is live when
    it was heard from within the lease period."""
    from datetime import UTC, datetime

    answer = jsonable(call(lambda api: api.workers()))
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    now = datetime.now(UTC)
    table = Table()
    columns = ("hostname", "pid", "version", "queue", "devices", "live", "last seen", "running")
    for column in columns:
        table.add_column(column)
    for w in answer["workers"]:
        seen = (now - datetime.fromisoformat(w["last_seen_at"])).total_seconds()
        # A run the token may not see is not named: the worker is only busy.
        running = f"{w['run_id']} ({w['attempt_id']})" if w.get("run_id") else "-"
        if running == "-" and w.get("busy"):
            running = "busy"
        running = assignment_text(w) or running
        table.add_row(
            w["hostname"],
            str(w["pid"]),
            w["version"],
            w.get("queue") or "-",
            devices_text(w),
            "yes" if w["live"] else "no",
            f"{max(seen, 0):.0f} s ago",
            running,
        )
    console.print(table)
    console.print(f"{answer['live']} live of {answer['count']} worker(s) heard from")


def assignment_text(worker: dict[str, Any]) -> str | None:
    """What the scheduler placed on the worker: `run (attempt) member k, placed` until its
    claim, then `running`; None when nothing is placed on it."""
    placed = worker.get("assignment")
    if not placed:
        return None
    what = f"{placed['run_id']} ({placed['attempt_id']})" if placed.get("run_id") else "another's"
    member = f" member {placed['member']}" if placed.get("member") else ""
    state = "running" if placed.get("claimed") else "placed"
    return f"{what}{member}, {state}, priority {placed['priority']}"


def queue_list(
    limit: Annotated[int, typer.Option(min=1, max=500, help="Show at most this many.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """List queued attempts in placement order (GET /queue): position, priority, owner,
    devices x nodes and why each waits (no worker big enough, the owner's quota, behind
    higher priorities, a gang waiting for free workers, preempting lower ones)."""
    answer = jsonable(call(lambda api: api.queue(limit=limit)))
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    table = Table()
    for column in ("#", "run", "attempt", "priority", "owner", "devices", "waits"):
        table.add_column(column)
    for q in answer["attempts"]:
        table.add_row(
            str(q["position"]),
            f"{q['run_id']} ({q['run_name']})",
            q["attempt_id"],
            str(q["priority"]),
            q.get("owner_id") or "-",
            f"{q['devices']} x {q['nodes']}" if q["nodes"] > 1 else str(q["devices"]),
            q["reason"],
        )
    console.print(table)
    console.print(f"{answer['count']} queued attempt(s)")


def devices_text(worker: dict[str, Any]) -> str:
    """`2 cuda`: what a worker's ping says it owns; `-` before its first ping (the service
    counts it as one device)."""
    devices = worker.get("devices")
    if devices is None:
        return "-"
    kind = worker.get("device_kind")
    return f"{devices} {kind}" if kind else str(devices)
