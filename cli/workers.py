"""`trainctl workers`: the workers the service has heard from, what they own and run."""

from __future__ import annotations

import json
from typing import Any

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


def devices_text(worker: dict[str, Any]) -> str:
    """`2 cuda`: what a worker's ping says it owns; `-` before its first ping (the service
    counts it as one device)."""
    devices = worker.get("devices")
    if devices is None:
        return "-"
    kind = worker.get("device_kind")
    return f"{devices} {kind}" if kind else str(devices)
