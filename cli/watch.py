"""Following a run until it stops: a progress bar for people, JSON lines for scripts.

Polls `GET /runs/{id}` and the latest `tokens_per_s` once per `poll` seconds; a run stops being
watched when it is finished or paused.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from client import ApiError, Client

# A watched run stops being followed in these states (paused waits for a resume).
STOPPED = frozenset({"succeeded", "failed", "cancelled", "paused"})


def snapshot(api: Client, run_id: str) -> dict[str, Any]:
    """What `watch` shows of a run now."""
    run = api.get_run(run_id).model_dump(mode="json")
    series = api.metrics(run_id, names=["tokens_per_s"], max_points=1).root.get("tokens_per_s")
    speed = series.values if series else []
    return {
        "id": run["id"],
        "status": run["status"],
        "phase": run.get("phase"),
        "step": run["step"],
        "total_steps": run["total_steps"],
        "tokens_per_s": speed[-1] if speed else None,
        "restarts": run.get("restarts", 0),
        "preemptions": run.get("preemptions", 0),
        "waiting_for_worker": run.get("waiting_for_worker", False),
        "waiting_reason": waiting_reason(run),
        "preparing": run.get("preparing"),
        "cause": run.get("cause"),
        "message": run.get("message"),
    }


# How long `watch` rides out an unreachable or failing service (a restart) before giving up.
OUTAGE_GRACE_SECONDS = 60.0


def _patient_snapshot(api: Client, run_id: str, *, poll: float) -> dict[str, Any]:
    """`snapshot`, retried while the service is unreachable or answers 5xx, up to
    OUTAGE_GRACE_SECONDS: a run outlives a service restart, and so does its watcher."""
    deadline = time.monotonic() + OUTAGE_GRACE_SECONDS
    while True:
        try:
            return snapshot(api, run_id)
        except ApiError as err:
            if (err.status != 0 and err.status < 500) or time.monotonic() > deadline:
                raise
            time.sleep(poll)


def watch(
    api: Client,
    run_id: str,
    *,
    timeout: float,
    console: Console,
    poll: float = 1.0,
    as_json: bool = False,
) -> dict[str, Any]:
    """Follow the run until it stops (see STOPPED) and return its last snapshot. With
    `as_json`, print a JSON line whenever the snapshot changes, instead of a progress bar.
    Raises TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    state = snapshot(api, run_id)
    if as_json:
        print(json.dumps(state), flush=True)
        while state["status"] not in STOPPED:
            _wait(deadline, poll, run_id, timeout)
            new = _patient_snapshot(api, run_id, poll=poll)
            if new != state:
                print(json.dumps(new), flush=True)
            state = new
        return state
    with Progress(
        TextColumn("[bold]{task.fields[phase]}"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[restarts]}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        f = _fields(state)
        bar = progress.add_task(
            "run",
            total=state["total_steps"],
            completed=state["step"],
            phase=f["phase"],
            speed=f["speed"],
            restarts=f["restarts"],
            status=f["status"],
        )
        while state["status"] not in STOPPED:
            _wait(deadline, poll, run_id, timeout)
            state = _patient_snapshot(api, run_id, poll=poll)
            f = _fields(state)
            progress.update(
                bar,
                completed=state["step"],
                phase=f["phase"],
                speed=f["speed"],
                restarts=f["restarts"],
                status=f["status"],
            )
    return state


def _fields(state: dict[str, Any]) -> dict[str, str]:
    speed = state["tokens_per_s"]
    recoveries = state["restarts"] + state["preemptions"]
    return {
        "phase": state["phase"] or "-",
        "speed": f"{speed:,.0f} tok/s" if speed is not None else "- tok/s",
        "restarts": f"{recoveries} restarts" if recoveries else "",
        "status": state["status"]
        + (_waiting(state) if state["waiting_for_worker"] else "")
        + (f" ({preparing_text(state['preparing'])})" if state.get("preparing") else ""),
    }


def waiting_reason(run: dict[str, Any]) -> str | None:
    """Why the run waits for a worker, as the service says (None while it does not, or from a
    service that does not say)."""
    if not run.get("waiting_for_worker"):
        return None
    reason = run.get("waiting_reason")
    return reason if isinstance(reason, str) and reason else None


def _waiting(state: dict[str, Any]) -> str:
    # The progress bar's columns read rich markup: a queue's name is shown as it is.
    reason = state.get("waiting_reason")
    return f" (waiting for a worker: {escape(reason)})" if reason else " (waiting for a worker)"


def preparing_text(preparing: dict[str, Any]) -> str:
    """`preparing: 41% of pretrain.jsonl`: a run's attempt tokenizing a file into its store."""
    name = preparing["file"].rsplit("/", 1)[-1]
    return f"preparing: {preparing['fraction']:.0%} of {name}"


def _wait(deadline: float, poll: float, run_id: str, timeout: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"run {run_id} still running after {timeout:.0f} s")
    time.sleep(poll)
