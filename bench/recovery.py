"""Recovery time with real processes, on the embedded stack (SQLite + filesystem broker) and on
Postgres + Redis: seconds from the death (SIGKILL) or the preemption notice (SIGTERM) of the
worker training a phase to the first optimizer step of the next attempt, and what a restart of
the service itself (the API process stopped and started again) costs a run that is training.

Each stack is the API (`trainctl up --workers 0`, or `trainctl serve` on a fresh Postgres
database and its own Redis queue) and two `trainctl worker` processes started here, each
serving its Prometheus metrics on a port of its own (TRAINCTL_METRICS_PORT). A
repetition submits the demo's pretraining phase alone (400 steps, or for a restart as many as
it could train meanwhile at full speed; a checkpoint every 20, no evals) and waits until the
run reports step >= 30 (--kill-at). Then, by kind (--kinds):

- sigkill, sigterm: the worker whose pid the current attempt names is signalled, and the API
  is polled every 0.1 s until the run's `loss` series holds the step after the resume
  checkpoint again (the resuming claim deletes the points after it). The total is split, from
  the attempts' timestamps and the polls, into
  - SIGKILL: lease wait (kill -> last renewal + TRAINCTL_LEASE_SECONDS), reaper pickup (-> the
    reaper marks the attempt lost and queues the next; at most
    TRAINCTL_REAPER_INTERVAL_SECONDS), claim (-> the other worker's claim: dispatch, broker
    delivery, claim) and first step (-> the first step of the new attempt seen by the API:
    load the checkpoint, build the model, verify digests, one step, and up to
    TRAINCTL_HEARTBEAT_SECONDS of report batching, since a worker posts its metric points at
    most that often);
  - SIGTERM: hand back (signal -> checkpoint written and the attempt finished `preempted`, the
    next one queued at once), claim and first step as above. No lease is waited for.
- restart: the API process is stopped (SIGTERM to its process group, as a deployment does),
  kept down for 3 x TRAINCTL_LEASE_SECONDS, and started again on the same port with the same
  settings (the same TRAINCTL_HOME, or the same database). Measured: down (SIGTERM -> the API
  healthy again: the run is not visible); catch-up (-> the `loss` series holds a step after
  the last one the worker had reached before the restart, its `trainctl_worker_step` gauge
  scraped just before the restart: its spool was delivered); the attempts created, and those
  lost or preempted, from the stop until a lease and two reaper intervals after the restart
  (the reaper's grace at start-up must keep both at 0); steps redone (the last step reached
  minus the checkpoint a new attempt resumed from; 0 without one); the reports in the
  worker's spool just before the restart; the steps trained while the API was down (from
  the last step the API showed at the stop, made just after a report batch arrived, to the
  last reached), found in the series after the catch-up (those missing there are reports
  lost); and the training rate while down against the rate after the catch-up. Training
  seconds lost = down x (1 - rate down / rate up) + steps redone / rate up.

Then the run is cancelled and a fresh worker replaces a signalled one.

The SIGKILL total is dominated by the lease: the service cannot tell a dead worker from a slow
one before its lease lapses, so it is about TRAINCTL_LEASE_SECONDS minus the time since the
last heartbeat, plus up to one reaper interval. The settings used are printed with the tables.

    .venv/bin/python bench/recovery.py [--reps 3] [--stacks embedded,postgres]
        [--kinds sigkill,sigterm,restart] [--lease 10] [--reaper 2] [--heartbeat 1]

Needs Postgres (TEST_POSTGRES_URL, default postgresql://postgres@127.0.0.1:5432/test; a
database is created and dropped) and Redis (TEST_REDIS_URL) for the `postgres` stack. Prints
markdown tables of medians (and ranges); exits 1 with the processes' log tails on a failure.
Every process it starts is stopped, and its temporary directories removed, on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from cli.stack import Proc, child_env, free_port, wait_healthy
from runtime.path import resolve_paths

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "workflows" / "demo.json"
POSTGRES_ADMIN_URL = os.environ.get(
    "TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
STEPS = 400
CHECKPOINT_EVERY = 20
POLL_SECONDS = 0.1
WAIT_SECONDS = 120.0  # the longest any one stage may take before the bench gives up


class BenchError(Exception):
    pass


# --- processes (cli.stack.Proc, as the integration tests use) ---------------------------


def run_cli(args: list[str], *, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=child_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise BenchError(f"trainctl {' '.join(args)} failed: {result.stderr}{result.stdout}")
    return result.stdout


def wait_until(what: str, check: Callable[[], Any], *, timeout: float = WAIT_SECONDS) -> Any:
    """Poll `check` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_SECONDS)


# --- stacks ---------------------------------------------------------------------------------


@dataclass
class Stack:
    """An API and its worker processes; `worker_env` is what a worker needs to join, and
    `api_args` and `api_env` how the API was started (to start it again); `metrics_ports` the
    port each worker (by pid) serves its Prometheus metrics on."""

    name: str
    tmp: Path
    url: str
    admin: str
    worker_env: dict[str, str]
    api_args: list[str]
    api_env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    metrics_ports: dict[int, int] = field(default_factory=dict)

    def api(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.admin}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def start_worker(self) -> Proc:
        n = sum(1 for p in self.procs if p.log.name.startswith("worker"))
        port = free_port()
        env = {**self.worker_env, "TRAINCTL_METRICS_PORT": str(port)}
        proc = Proc(["worker"], env=env, log=self.tmp / f"worker-{n + 1}.log")
        self.metrics_ports[proc.pid] = port
        self.procs.append(proc)
        self.workers.append(proc)
        return proc

    def start_workers(self, count: int) -> None:
        """Start workers until `count` are alive (without waiting for them)."""
        self.workers = [w for w in self.workers if w.alive()]
        for _ in range(count - len(self.workers)):
            self.start_worker()

    def ensure_workers(self, count: int) -> None:
        """`count` live workers, each past Celery's start-up banner (consuming)."""
        self.workers = [w for w in self.workers if w.alive()]
        started = count - len(self.workers)
        for _ in range(started):
            self.start_worker()
        for proc in self.workers:

            def ready(proc: Proc = proc) -> bool:
                if not proc.alive():
                    raise BenchError(f"{proc.log.name} exited while starting:\n{proc.tail()}")
                return "[queues]" in proc.log.read_text(errors="replace")

            wait_until(f"{proc.log.name} to start", ready, timeout=90)
        if started > 0:
            time.sleep(1.0)  # the banner is printed just before the consumer connects

    def stop_api(self) -> None:
        """SIGTERM to the API's process group (SIGKILL after 20 s), as a deployment does."""
        for proc in self.procs:
            if proc.log.name == "api.log" and proc.alive():
                proc.stop()

    def restart_api(self) -> None:
        """The API again, on the same port with the same settings; returns once healthy."""
        port = int(self.url.rsplit(":", 1)[1])
        start_api(self.api_args, env=self.api_env, tmp=self.tmp, procs=self.procs, port=port)


def start_api(
    args: list[str],
    *,
    env: dict[str, str],
    tmp: Path,
    procs: list[Proc],
    port: int | None = None,
) -> str:
    port = port or free_port()
    proc = Proc([*args, "--port", str(port)], env=env, log=tmp / "api.log")
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=90, process=proc.popen)
    except RuntimeError as err:
        raise BenchError(f"{err}\n{proc.tail()}") from err
    return url


@contextmanager
def embedded_stack(service_env: dict[str, str], worker_env: dict[str, str]) -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="trainctl-bench-recovery-"))
    home = tmp / "home"
    procs: list[Proc] = []
    try:
        env = {"TRAINCTL_HOME": str(home), **service_env}
        api_args = ["up", "--workers", "0"]
        url = start_api(api_args, env=env, tmp=tmp, procs=procs)
        yield Stack(
            name="embedded (SQLite + filesystem broker)",
            tmp=tmp,
            url=url,
            admin=(home / "token").read_text().strip(),
            worker_env={
                "TRAINCTL_HOME": str(home),
                "TRAINCTL_API_URL": url,
                "TRAINCTL_WORKER_TOKEN": (home / "worker-token").read_text().strip(),
                "TRAINCTL_BROKER_URL": f"filesystem://{home / 'broker'}",
                **worker_env,
            },
            api_args=api_args,
            api_env=env,
            procs=procs,
        )
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def postgres_stack(service_env: dict[str, str], worker_env: dict[str, str]) -> Iterator[Stack]:
    import psycopg
    import redis
    from psycopg import sql

    tmp = Path(tempfile.mkdtemp(prefix="trainctl-bench-recovery-"))
    database = f"tc_bench_{uuid.uuid4().hex[:12]}"
    queue = f"bench-recovery-{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    created = False
    try:
        try:
            with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
                created = True
            redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5).ping()
        except (psycopg.Error, redis.RedisError) as err:
            raise BenchError(
                f"Postgres ({POSTGRES_ADMIN_URL}) or Redis ({REDIS_URL}) unavailable: {err}"
            ) from err
        base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0].replace(
            "postgresql://", "postgresql+psycopg://"
        )
        env = {
            "TRAINCTL_HOME": str(tmp / "home"),
            "TRAINCTL_DATABASE_URL": f"{base}/{database}",
            "TRAINCTL_BROKER_URL": REDIS_URL,
            "TRAINCTL_QUEUE": queue,
            "TRAINCTL_ARTIFACT_ROOT": str(tmp / "artifacts"),
        }
        api_env = {**env, **service_env}
        url = start_api(["serve"], env=api_env, tmp=tmp, procs=procs)
        admin = run_cli(["tokens", "create", "--name", "bench", "--role", "admin"], env=env)
        worker = run_cli(["tokens", "create", "--name", "bench", "--role", "worker"], env=env)
        yield Stack(
            name="Postgres + Redis",
            tmp=tmp,
            url=url,
            admin=admin.strip(),
            worker_env={
                **env,
                "TRAINCTL_API_URL": url,
                "TRAINCTL_WORKER_TOKEN": worker.strip(),
                **worker_env,
            },
            api_args=["serve"],
            api_env=api_env,
            procs=procs,
        )
    finally:
        stop_all(procs)
        if created:
            with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(database)
                    )
                )
        forget_queue(queue)
        shutil.rmtree(tmp, ignore_errors=True)


def forget_queue(queue: str) -> None:
    """Delete this bench's Redis queue and the unacknowledged messages a SIGKILLed worker left
    for it (kombu keeps them in the shared `unacked` hash; only this queue's are removed)."""
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
        client.delete(queue)
        for tag, raw in client.hscan_iter("unacked"):
            try:
                routing_key = json.loads(raw)[2]
            except (ValueError, IndexError, TypeError):
                continue
            if routing_key == queue:
                client.hdel("unacked", tag)
                client.zrem("unacked_index", tag)
    except redis.RedisError as err:
        print(f"warning: could not clean Redis queue {queue}: {err}", file=sys.stderr)


def stop_all(procs: list[Proc]) -> None:
    for proc in reversed(procs):
        try:
            proc.stop()
        except OSError as err:
            print(f"warning: stopping {proc.log.name}: {err}", file=sys.stderr)


# --- one measurement ------------------------------------------------------------------------


def workflow(steps: int) -> dict[str, Any]:
    """The demo's pretraining phase alone, long enough to outlast a measurement."""
    doc = resolve_paths(json.loads(DEMO.read_text()), DEMO.parent)
    pretrain = next(p for p in doc["phases"] if p["objective"] == "continued_pretrain")
    doc["phases"] = [{**pretrain, "steps": steps}]
    doc["checkpoint"] = {"every_steps": CHECKPOINT_EVERY, "keep_last": 2}
    doc["evals"] = []
    return doc


def epoch(value: str | None) -> float:
    if value is None:
        raise BenchError("a timestamp the bench needs is missing")
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:  # SQLite hands back naive UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


class Watched:
    """One submitted run, read through the API; a read fails fast once the run has ended."""

    def __init__(self, api: httpx.Client, *, steps: int) -> None:
        self.api = api
        response = api.post("/runs", json={"workflow": workflow(steps), "max_preemptions": 5})
        if response.status_code != 201:
            raise BenchError(f"POST /runs: {response.status_code} {response.text}")
        self.id: str = response.json()["id"]

    def get(self) -> dict[str, Any]:
        run: dict[str, Any] = self.api.get(f"/runs/{self.id}").json()
        if run["status"] in ("failed", "cancelled", "succeeded"):
            raise BenchError(f"run {self.id} ended {run['status']}: {run.get('message')}")
        return run

    def loss_steps(self) -> list[int]:
        self.get()
        series = self.api.get(f"/runs/{self.id}/metrics", params={"names": "loss"}).json()
        steps: list[int] = series.get("loss", {}).get("steps", [])
        return steps

    def wait_for_step(self, step: int) -> dict[str, Any]:
        def far_enough() -> dict[str, Any] | None:
            run = self.get()
            return run if run["status"] == "running" and run["step"] >= step else None

        submitted = time.monotonic()
        run: dict[str, Any] = wait_until(f"run {self.id} to reach step {step}", far_enough)
        print(f"  step {run['step']} after {time.monotonic() - submitted:.1f} s", file=sys.stderr)
        return run

    def cancel(self) -> None:
        self.api.post(f"/runs/{self.id}/cancel")
        wait_until(
            f"run {self.id} to be cancelled",
            lambda: self.api.get(f"/runs/{self.id}").json()["status"] == "cancelled",
        )


@dataclass
class Sample:
    total: float
    ended: float  # SIGKILL: kill -> lease expiry; SIGTERM: signal -> attempt finished
    reaped: float | None  # SIGKILL only: lease expiry -> attempt marked lost, next queued
    claimed: float  # -> the next attempt claimed by the other worker
    first_step: float  # -> the first step after the resume checkpoint seen by the API
    resumed_from: int


def measure(
    stack: Stack, api: httpx.Client, sig: signal.Signals, *, kill_at: int, lease: float
) -> Sample:
    stack.ensure_workers(2)
    watched = Watched(api, steps=STEPS)
    run = watched.wait_for_step(kill_at)
    first = run["attempts"][-1]
    victim = next((w for w in stack.workers if w.pid == first["worker_pid"]), None)
    if victim is None:
        raise BenchError(f"attempt {first['number']} names pid {first['worker_pid']}, not ours")
    stack.workers.remove(victim)  # stopped with the others at the end if still alive
    signalled = time.time()
    if sig == signal.SIGKILL:
        os.killpg(victim.pid, signal.SIGKILL)
    else:
        os.kill(victim.pid, signal.SIGTERM)

    def next_claimed() -> dict[str, Any] | None:
        run = watched.get()
        latest = run["attempts"][-1]
        new = latest["number"] > first["number"] and latest["claimed_at"] is not None
        return run if new else None

    run = wait_until("the next attempt to be claimed", next_claimed)
    old, new = run["attempts"][-2], run["attempts"][-1]
    if new["worker_pid"] == victim.pid:
        raise BenchError(
            f"the {sig.name}ed worker (pid {victim.pid}) claimed the next attempt itself; "
            f"attempts: {json.dumps(run['attempts'], indent=1)}"
        )
    expected = "lost" if sig == signal.SIGKILL else "preempted"
    if old["status"] != expected:
        raise BenchError(f"attempt {old['number']} ended {old['status']}, not {expected}")
    resumed_from = run["latest_checkpoint"]["step"]

    def first_new_step() -> float | None:
        steps = watched.loss_steps()
        return time.time() if steps and steps[-1] > resumed_from else None

    stepped = wait_until("the first step of the next attempt", first_new_step)
    claimed, finished = epoch(new["claimed_at"]), epoch(old["finished_at"])
    if sig == signal.SIGKILL:
        expired = epoch(old["heartbeat_at"]) + lease  # the last renewal's lease end
        ended, reaped = expired - signalled, finished - expired
    else:
        ended, reaped = finished - signalled, None

    # Leave the survivor idle for the next repetition, and replace the signalled worker.
    stack.start_workers(2)
    watched.cancel()
    if sig == signal.SIGTERM:
        try:
            victim.popen.wait(timeout=30)
        except subprocess.TimeoutExpired as err:
            raise BenchError(f"the SIGTERMed worker did not exit:\n{victim.tail()}") from err
    return Sample(
        total=stepped - signalled,
        ended=ended,
        reaped=reaped,
        claimed=claimed - finished,
        first_step=stepped - claimed,
        resumed_from=resumed_from,
    )


@dataclass
class RestartSample:
    down: float  # SIGTERM to the API -> healthy again: the run is not visible
    catch_up: float  # healthy -> the series holds a step after the last one reached
    new_attempts: int  # attempts created from the stop to the end of the observation
    lost: int  # of all the run's attempts, those that became lost or preempted meanwhile
    redone: int  # last step reached - the checkpoint a new attempt resumed from (0: none)
    spooled: int  # reports in the worker's spool just before the restart
    while_down: int  # steps trained while the API was down, found in the series after
    missing: int  # steps trained while the API was down but absent from the series: lost
    rate_down: float  # steps/s while the API was down
    rate_up: float  # steps/s after the catch-up

    @property
    def training_lost(self) -> float:
        """Seconds of training the restart cost: the slowdown while down, plus steps redone."""
        if self.rate_up <= 0:
            return float("nan")
        return self.down * max(0.0, 1 - self.rate_down / self.rate_up) + self.redone / self.rate_up


def spooled_reports(spool: Path) -> int:
    """How many reports an attempt's spool directory holds (`worker/link/spool.py`: one file
    each)."""
    return len(list(spool.glob("*.json"))) if spool.is_dir() else 0


def worker_step(port: int) -> int:
    """The last step a worker trained: its `trainctl_worker_step` gauge (worker/metrics.py),
    set after every optimizer step, read from the metrics it serves on `port`."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError as err:
        raise BenchError(f"the worker's metrics on port {port}: {err}") from err
    found = re.search(r"^trainctl_worker_step (\S+)$", text, re.MULTILINE)
    if found is None:
        raise BenchError(f"no trainctl_worker_step gauge in the worker's metrics on port {port}")
    return int(float(found.group(1)))


def measure_restart(
    stack: Stack, api: httpx.Client, *, kill_at: int, lease: float, reaper: float
) -> RestartSample:
    stack.ensure_workers(2)
    # Long enough to train through the outage and the observation after it at full speed.
    watched = Watched(api, steps=kill_at + int(20 * (4 * lease + 2 * reaper + WAIT_SECONDS)))
    run = watched.wait_for_step(kill_at)
    before = run["attempts"]
    ended_before = sum(a["status"] in ("lost", "preempted") for a in before)
    trainer = next((w for w in stack.workers if w.pid == before[-1]["worker_pid"]), None)
    if trainer is None:
        raise BenchError(f"attempt {before[-1]['number']} names pid {before[-1]['worker_pid']}")
    spool = Path(stack.worker_env["TRAINCTL_HOME"]) / "spool" / before[-1]["id"]
    resumed_from: int | None = None  # the checkpoint a new attempt started from, if any

    def note(run: dict[str, Any]) -> dict[str, Any]:
        nonlocal resumed_from
        if resumed_from is None and len(run["attempts"]) > len(before):
            resumed_from = run["latest_checkpoint"]["step"]
        return run

    # Stop just after a report batch arrived, so that the last step the API shows is the
    # worker's step at the stop to within a poll (the API otherwise lags by up to
    # TRAINCTL_HEARTBEAT_SECONDS of steps).
    shown = max(watched.loss_steps(), default=0)

    def batch_arrived() -> int | None:
        newest = max(watched.loss_steps(), default=0)
        return newest if newest > shown else None

    last_seen: int = wait_until("a report batch", batch_arrived)
    stopped = time.time()
    stack.stop_api()
    time.sleep(max(0.0, stopped + 3 * lease - time.time()))
    read = time.time()
    reached = worker_step(stack.metrics_ports[trainer.pid])  # the last step before the restart
    spooled = spooled_reports(spool)
    stack.restart_api()
    healthy = time.time()

    def caught_up() -> tuple[float, int] | None:
        note(watched.get())
        steps = watched.loss_steps()
        return (time.time(), steps[-1]) if steps and steps[-1] > reached else None

    caught, caught_step = wait_until("the spooled steps to reach the API", caught_up)
    present = set(watched.loss_steps())
    while_down = sum(s in present for s in range(last_seen + 1, reached + 1))

    # A lease the restart broke is reaped within a lease and a reaper pass of the start-up
    # grace: watch that long (and 5 s at least), measuring the training rate meanwhile.
    observe_until = max(healthy + lease + 2 * reaper + 1.0, caught + 5.0)

    def observed() -> bool:
        note(watched.get())
        return time.time() > observe_until

    wait_until("the observation to end", observed)
    done, done_step = time.time(), max(watched.loss_steps())
    after = watched.get()["attempts"]
    watched.cancel()
    return RestartSample(
        down=healthy - stopped,
        catch_up=caught - healthy,
        new_attempts=len(after) - len(before),
        lost=sum(a["status"] in ("lost", "preempted") for a in after) - ended_before,
        redone=max(0, reached - resumed_from) if resumed_from is not None else 0,
        spooled=spooled,
        while_down=while_down,
        missing=reached - last_seen - while_down,
        rate_down=(reached - last_seen) / (read - stopped),
        rate_up=(done_step - caught_step) / (done - caught),
    )


# --- report ---------------------------------------------------------------------------------


def cell(values: Sequence[float | None], digits: int = 2) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "—"
    median = statistics.median(present)
    if min(present) == max(present):
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(present):.{digits}f} to {max(present):.{digits}f})"


def table(results: list[tuple[str, str, list[Sample]]]) -> str:
    lines = [
        "| stack | signal | n | total s | lease wait / hand back s | reaper pickup s "
        "| claim s | first step s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for stack, sig, samples in results:
        lines.append(
            f"| {stack} | {sig} | {len(samples)} | {cell([s.total for s in samples])} "
            f"| {cell([s.ended for s in samples])} | {cell([s.reaped for s in samples])} "
            f"| {cell([s.claimed for s in samples])} | {cell([s.first_step for s in samples])} |"
        )
    return "\n".join(lines)


def restart_table(results: list[tuple[str, list[RestartSample]]]) -> str:
    lines = [
        "| stack | n | down s | catch-up s | new attempts | lost or preempted | steps redone "
        "| reports spooled | steps while down | of them missing | steps/s down | steps/s up "
        "| training s lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stack, samples in results:
        lines.append(
            f"| {stack} | {len(samples)} | {cell([s.down for s in samples])} "
            f"| {cell([s.catch_up for s in samples])} "
            f"| {cell([s.new_attempts for s in samples], 0)} "
            f"| {cell([s.lost for s in samples], 0)} | {cell([s.redone for s in samples], 0)} "
            f"| {cell([s.spooled for s in samples], 0)} "
            f"| {cell([s.while_down for s in samples], 0)} "
            f"| {cell([s.missing for s in samples], 0)} "
            f"| {cell([s.rate_down for s in samples], 1)} "
            f"| {cell([s.rate_up for s in samples], 1)} "
            f"| {cell([s.training_lost for s in samples], 1)} |"
        )
    return "\n".join(lines)


SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}
KINDS = [*SIGNALS, "restart"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stacks", default="embedded,postgres")
    parser.add_argument("--kinds", default=",".join(KINDS), help="what to measure, in order")
    parser.add_argument("--lease", type=float, default=10.0, help="TRAINCTL_LEASE_SECONDS")
    parser.add_argument(
        "--reaper", type=float, default=2.0, help="TRAINCTL_REAPER_INTERVAL_SECONDS"
    )
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="workers' TRAINCTL_HEARTBEAT_SECONDS"
    )
    parser.add_argument(
        "--kill-at", type=int, default=30, help="signal or stop the API at this step or later"
    )
    args = parser.parse_args()

    service_env = {
        "TRAINCTL_LEASE_SECONDS": str(args.lease),
        "TRAINCTL_REAPER_INTERVAL_SECONDS": str(args.reaper),
    }
    worker_env = {
        "TRAINCTL_HEARTBEAT_SECONDS": str(args.heartbeat),
        "TRAINCTL_TORCH_THREADS": "1",
    }
    factories = {"embedded": embedded_stack, "postgres": postgres_stack}
    names = [n.strip() for n in args.stacks.split(",") if n.strip()]
    unknown = [n for n in names if n not in factories]
    if unknown:
        parser.error(f"unknown stack(s) {unknown}; choose from {sorted(factories)}")
    kinds = [k.strip().lower() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kind(s) {unknown}; choose from {KINDS}")

    started = time.monotonic()
    results: list[tuple[str, str, list[Sample]]] = []
    restarts: list[tuple[str, list[RestartSample]]] = []
    for name in names:
        with factories[name](service_env, worker_env) as stack:
            try:
                with stack.api() as api:
                    for kind in kinds:
                        if kind == "restart":
                            restarts.append((stack.name, measure_restarts(stack, api, args)))
                            continue
                        sig = SIGNALS[kind]
                        samples = []
                        for rep in range(args.reps):
                            sample = measure(
                                stack, api, sig, kill_at=args.kill_at, lease=args.lease
                            )
                            print(
                                f"{name} {sig.name} #{rep + 1}: {sample.total:.2f} s "
                                f"(resumed from step {sample.resumed_from})",
                                file=sys.stderr,
                            )
                            samples.append(sample)
                        results.append((stack.name, sig.name, samples))
            except BenchError:
                for log in dict.fromkeys(proc.log for proc in stack.procs):
                    text = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
                    print(f"--- {log.name} ---\n{text}", file=sys.stderr)
                raise

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, CPU, 1 torch thread per worker; "
        f"TRAINCTL_LEASE_SECONDS={args.lease:g}, TRAINCTL_REAPER_INTERVAL_SECONDS="
        f"{args.reaper:g}, TRAINCTL_HEARTBEAT_SECONDS={args.heartbeat:g}; signal at step >= "
        f"{args.kill_at}, checkpoint every {CHECKPOINT_EVERY} steps; {args.reps} repetitions, "
        f"median (min to max); bench took {time.monotonic() - started:.0f} s\n"
    )
    if results:
        print(table(results))
    if restarts:
        print(f"\nservice restart: the API down for 3 x {args.lease:g} s\n")
        print(restart_table(restarts))
    return 0


def measure_restarts(
    stack: Stack, api: httpx.Client, args: argparse.Namespace
) -> list[RestartSample]:
    samples = []
    for rep in range(args.reps):
        sample = measure_restart(
            stack, api, kill_at=args.kill_at, lease=args.lease, reaper=args.reaper
        )
        print(
            f"{stack.name} restart #{rep + 1}: down {sample.down:.2f} s, catch-up "
            f"{sample.catch_up:.2f} s, {sample.new_attempts} new attempt(s), {sample.lost} "
            f"lost or preempted, {sample.spooled} reports spooled, {sample.while_down} steps "
            f"while down ({sample.missing} missing after)",
            file=sys.stderr,
        )
        samples.append(sample)
    return samples


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as err:
        print(f"bench/recovery.py failed: {err}", file=sys.stderr)
        sys.exit(1)
