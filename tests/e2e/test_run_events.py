"""`GET /runs/{id}/events` on a live `trainctl serve` (uvicorn, Postgres, Redis), read as a client
reads a stream: a finished run's replay and end, a running run's live points, heartbeats and
rewinds, and a server that stops promptly while a stream is open."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    SETS,
    TOTAL_STEPS,
    LiveStack,
    eval_results,
    live_stack,
    loss_at,
    metric_points,
    parse_events,
)

pytestmark = pytest.mark.integration

METRICS = {"loss", "lr", "lr_muon", "grad_norm", "tokens_per_s"}


def read_until_closed(live: LiveStack, run_id: str, timeout: float = 30, **params: Any) -> str:
    with httpx.Client(base_url=live.url, timeout=timeout) as client:
        response = client.get(
            f"/runs/{run_id}/events",
            params=params,
            headers={"Authorization": f"Bearer {live.admin_token}"},
        )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return response.text


def metric_steps(events: list[tuple[str, Any]]) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for name, data in events:
        if name == "metrics":
            for metric, column in data["series"].items():
                steps.setdefault(metric, []).extend(column["steps"])
    return steps


def eval_keys(events: list[tuple[str, Any]]) -> list[tuple[str, int]]:
    return [
        (p["name"], p["step"]) for name, data in events if name == "evals" for p in data["points"]
    ]


def test_events_of_a_finished_run_replay_it_then_end_and_close(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run_id = live.finished_run()

        events = parse_events(read_until_closed(live, run_id))
        names = [name for name, _ in events]
        # The run first, its points, and `end` last, after which the server closed the stream.
        assert names[0] == "run" and names[-1] == "end", names
        assert names.count("run") == 1 and names.count("end") == 1
        assert events[0][1]["status"] == "succeeded"
        assert events[0][1]["step"] == TOTAL_STEPS
        assert events[-1][1] == {"status": "succeeded"}
        # Every point exactly once, in step order, for every metric workers report.
        steps = metric_steps(events)
        assert set(steps) == METRICS
        for metric in METRICS:
            assert steps[metric] == list(range(1, TOTAL_STEPS + 1)), metric
        evals = eval_keys(events)
        expected = {(n, s) for n in SETS for s in range(0, TOTAL_STEPS + 1, 5)}
        assert len(evals) == len(expected) and set(evals) == expected

        # What a client already holds is not sent again; `names` picks the series.
        later = parse_events(
            read_until_closed(live, run_id, metrics_after=50, evals_after=55, names="loss")
        )
        assert metric_steps(later) == {"loss": list(range(51, TOTAL_STEPS + 1))}
        assert set(eval_keys(later)) == {(n, 60) for n in SETS}

        # The same bearer token as every read; nothing streams without it.
        with httpx.Client(base_url=live.url, timeout=10) as client:
            path = f"/runs/{run_id}/events"
            missing = client.get(path)
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "unauthorized"
            worker = client.get(
                path, headers={"Authorization": f"Bearer {live.stack.worker_token}"}
            )
            assert worker.status_code == 403
            # A token in the URL is not accepted: it would end up in logs and history.
            assert client.get(path, params={"token": live.admin_token}).status_code == 401
            unknown = client.get(
                "/runs/run_000000000000/events",
                headers={"Authorization": f"Bearer {live.admin_token}"},
            )
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "run_not_found"


class EventReader:
    """A stream read on a thread: events (and comments) arrive on a queue as they come."""

    def __init__(self, live: LiveStack, run_id: str, **params: Any) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.closed = threading.Event()
        self._client = httpx.Client(base_url=live.url, timeout=httpx.Timeout(10, read=60))
        self._request = self._client.build_request(
            "GET",
            f"/runs/{run_id}/events",
            params=params,
            headers={"Authorization": f"Bearer {live.admin_token}"},
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            response = self._client.send(self._request, stream=True)
            buffer = ""
            for chunk in response.iter_text():
                buffer += chunk
                while "\n\n" in buffer:
                    block, buffer = buffer.split("\n\n", 1)
                    for event in parse_events(block + "\n\n"):
                        self.events.put(event)
        except httpx.HTTPError:
            pass
        finally:
            self.closed.set()

    def next(self, wanted: str, timeout: float = 15) -> Any:
        """The data of the next `wanted` event (other events are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {wanted!r} event within {timeout} s")
            try:
                name, data = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if name == wanted:
                return data

    def collect(self, until: str, timeout: float = 15) -> list[tuple[str, Any]]:
        """Every event up to and including the next `until` event."""
        seen: list[tuple[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {until!r} event within {timeout} s; got {seen}")
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                continue
            seen.append(event)
            if event[0] == until:
                return seen

    def close(self) -> None:
        self._client.close()
        self._thread.join(timeout=10)


@contextmanager
def reading(live: LiveStack, run_id: str, **params: Any) -> Iterator[EventReader]:
    reader = EventReader(live, run_id, **params)
    try:
        yield reader
    finally:
        reader.close()


def test_events_follow_a_running_run_with_heartbeats_rewinds_and_its_end(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        # Phase 0 done (steps 1-30), phase 1 (summarization) at step 38, checkpoint at 30.
        run_id, worker = live.running_run(until=38)
        run = live.run(run_id)
        summarize = run["plan"]["phases"][1]

        with reading(live, run_id, metrics_after=38, evals_after=35) as reader:
            first = reader.next("run")
            assert (first["status"], first["phase"], first["step"]) == (
                "running",
                "sft_summarization",
                38,
            )

            # A new point reaches the open stream, and only it.
            worker.metrics(metric_points(39, summarize))
            got = reader.collect("metrics")
            assert got[-1][1]["series"]["loss"] == {"steps": [39], "values": [loss_at(39)]}
            # The run's step moved with the point (one transaction): its `run` event came first.
            assert [d["step"] for n, d in got if n == "run"] == [39]
            worker.evals(eval_results(40, summarize["name"]))
            points = reader.next("evals")["points"]
            # Two sets of one task (qa_reasoning, qa-rag) arrive as two points.
            assert {(p["name"], p["task"], p["step"]) for p in points} == {
                (n, t, 40) for n, t in SETS.items()
            }

            # An idle stream gets a comment every 15 s, so proxies keep it open.
            assert reader.next("comment", timeout=25).startswith("ping")

            # Preempted at 40 after a checkpoint there; the next attempt resumes from it, and the
            # service drops what was reported after 40: the stream says so, then sends anew.
            worker.metrics([p for s in (40, 41) for p in metric_points(s, summarize)])
            worker.checkpoint(40, 1, 10)
            assert reader.next("metrics")["series"]["loss"]["steps"] == [40, 41]
            worker.finish("preempted", 41)
            resumed, claim = live.claim_next(run_id)
            assert claim["resume_from"]["step"] == 40
            assert reader.next("rewind", timeout=10) == {"step": 40, "attempt": 3}
            resumed.metrics(metric_points(41, summarize))
            assert reader.next("metrics")["series"]["loss"]["steps"] == [41]

            # The run ends: its last points, its final state, `end`, and the stream closes.
            live.train(resumed, run, 1, first=42, last=summarize["last_step"])
            resumed.finish("succeeded", summarize["last_step"])
            planning = run["plan"]["phases"][2]
            last_worker, _ = live.claim_next(run_id)
            live.train(
                last_worker, run, 2, first=planning["first_step"], last=planning["last_step"]
            )
            last_worker.finish("succeeded", planning["last_step"])
            tail = reader.collect("end", timeout=20)
            assert tail[-1] == ("end", {"status": "succeeded"})
            final = [data for name, data in tail if name == "run"][-1]
            assert (final["status"], final["step"]) == ("succeeded", TOTAL_STEPS)
            streamed = [s for n, d in tail if n == "metrics" for s in d["series"]["loss"]["steps"]]
            assert streamed[-1] == TOTAL_STEPS
            assert reader.closed.wait(10), "the stream stayed open after `end`"


def test_serve_stops_promptly_while_an_event_stream_is_open(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run_id, _ = live.running_run(until=5)
        server = live.stack.procs[0]
        with reading(live, run_id) as reader:
            reader.next("run")
            started = time.monotonic()
            os.killpg(server.pid, signal.SIGTERM)
            # uvicorn waits for open responses before it exits (a plain StreamingResponse kept
            # it running until the run ended); the event stream must end itself on shutdown.
            server.popen.wait(timeout=15)
            assert time.monotonic() - started < 10
            # uvicorn re-raises the signal it handled once it has shut down cleanly.
            assert server.popen.returncode in (0, -signal.SIGTERM), server.tail()
            assert reader.closed.wait(10)
