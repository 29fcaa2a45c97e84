"""Recovery time with real processes: seconds from the death (SIGKILL) or the preemption notice
(SIGTERM) of the worker training a phase to the first optimizer step of the next attempt, on
the embedded stack (SQLite + filesystem broker) and on Postgres + Redis.

Each stack is the API (`trainctl up --workers 0`, or `trainctl serve` on a fresh Postgres
database and its own Redis queue) and two `trainctl worker` processes started here. A
repetition submits the demo's pretraining phase alone (400 steps, a checkpoint every 20, no
evals), waits until the run reports step >= 30, signals the worker whose pid the current
attempt names, and polls the API every 0.1 s until the run's `loss` series holds the step
after the resume checkpoint again (the resuming claim deletes the points after it). Then the
run is cancelled and a fresh worker replaces the signalled one. The total is split, from the
attempts' timestamps and the polls, into:

- SIGKILL: lease wait (kill -> last renewal + TRAINCTL_LEASE_SECONDS), reaper pickup (-> the
  reaper marks the attempt lost and queues the next; at most TRAINCTL_REAPER_INTERVAL_SECONDS),
  claim (-> the other worker's claim: dispatch, broker delivery, claim) and first step
  (-> the first step of the new attempt seen by the API: load the checkpoint, build the model,
  verify digests, one step, and up to TRAINCTL_HEARTBEAT_SECONDS of report batching, since
  a worker posts its metric points with its heartbeats);
- SIGTERM: hand back (signal -> checkpoint written and the attempt finished `preempted`, the
  next one queued at once), claim and first step as above. No lease is waited for.

The SIGKILL total is dominated by the lease: the service cannot tell a dead worker from a slow
one before its lease lapses, so it is about TRAINCTL_LEASE_SECONDS minus the time since the
last heartbeat, plus up to one reaper interval. The settings used are printed with the table.

    .venv/bin/python bench/recovery.py [--reps 3] [--stacks embedded,postgres]
        [--lease 10] [--reaper 2] [--heartbeat 1]

Needs Postgres (TEST_POSTGRES_URL, default postgresql://postgres@127.0.0.1:5432/test; a
database is created and dropped) and Redis (TEST_REDIS_URL) for the `postgres` stack. Prints a
markdown table of medians (and ranges); exits 1 with the processes' log tails on a failure.
Every process it starts is stopped, and its temporary directories removed, on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
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
    """An API and its worker processes; `worker_env` is what a worker needs to join."""

    name: str
    tmp: Path
    url: str
    admin: str
    worker_env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)

    def api(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.admin}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def start_worker(self) -> Proc:
        n = sum(1 for p in self.procs if p.log.name.startswith("worker"))
        proc = Proc(["worker"], env=self.worker_env, log=self.tmp / f"worker-{n + 1}.log")
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


def start_api(args: list[str], *, env: dict[str, str], tmp: Path, procs: list[Proc]) -> str:
    port = free_port()
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
        url = start_api(["up", "--workers", "0"], env=env, tmp=tmp, procs=procs)
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
        url = start_api(["serve"], env={**env, **service_env}, tmp=tmp, procs=procs)
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


def workflow() -> dict[str, Any]:
    """The demo's pretraining phase alone, long enough to outlast a measurement."""
    doc = resolve_paths(json.loads(DEMO.read_text()), DEMO.parent)
    pretrain = next(p for p in doc["phases"] if p["objective"] == "continued_pretrain")
    doc["phases"] = [{**pretrain, "steps": STEPS}]
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
    response = api.post("/runs", json={"workflow": workflow(), "max_preemptions": 5})
    if response.status_code != 201:
        raise BenchError(f"POST /runs: {response.status_code} {response.text}")
    run_id = response.json()["id"]

    def get_run() -> dict[str, Any]:
        run: dict[str, Any] = api.get(f"/runs/{run_id}").json()
        if run["status"] in ("failed", "cancelled", "succeeded"):
            raise BenchError(f"run {run_id} ended {run['status']}: {run.get('message')}")
        return run

    def far_enough() -> dict[str, Any] | None:
        run = get_run()
        return run if run["status"] == "running" and run["step"] >= kill_at else None

    submitted = time.monotonic()
    run = wait_until(f"run {run_id} to reach step {kill_at}", far_enough)
    print(f"  step {run['step']} after {time.monotonic() - submitted:.1f} s", file=sys.stderr)
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
        run = get_run()
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
        get_run()  # fails fast when the run ended instead
        series = api.get(f"/runs/{run_id}/metrics", params={"names": "loss"}).json()
        steps = series.get("loss", {}).get("steps", [])
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
    api.post(f"/runs/{run_id}/cancel")
    wait_until(
        f"run {run_id} to be cancelled",
        lambda: api.get(f"/runs/{run_id}").json()["status"] == "cancelled",
    )
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


# --- report ---------------------------------------------------------------------------------


def cell(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "—"
    median = statistics.median(present)
    if len(present) == 1:
        return f"{median:.2f}"
    return f"{median:.2f} ({min(present):.2f} to {max(present):.2f})"


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stacks", default="embedded,postgres")
    parser.add_argument("--lease", type=float, default=10.0, help="TRAINCTL_LEASE_SECONDS")
    parser.add_argument(
        "--reaper", type=float, default=2.0, help="TRAINCTL_REAPER_INTERVAL_SECONDS"
    )
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="workers' TRAINCTL_HEARTBEAT_SECONDS"
    )
    parser.add_argument("--kill-at", type=int, default=30, help="signal at this step or later")
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

    started = time.monotonic()
    results: list[tuple[str, str, list[Sample]]] = []
    for name in names:
        with factories[name](service_env, worker_env) as stack:
            try:
                with stack.api() as api:
                    for sig in (signal.SIGKILL, signal.SIGTERM):
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
                for proc in stack.procs:
                    print(f"--- {proc.log.name} ---\n{proc.tail()}", file=sys.stderr)
                raise

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, CPU, 1 torch thread per worker; "
        f"TRAINCTL_LEASE_SECONDS={args.lease:g}, TRAINCTL_REAPER_INTERVAL_SECONDS="
        f"{args.reaper:g}, TRAINCTL_HEARTBEAT_SECONDS={args.heartbeat:g}; signal at step >= "
        f"{args.kill_at}, checkpoint every {CHECKPOINT_EVERY} steps; {args.reps} repetitions, "
        f"median (min to max); bench took {time.monotonic() - started:.0f} s\n"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as err:
        print(f"bench/recovery.py failed: {err}", file=sys.stderr)
        sys.exit(1)
