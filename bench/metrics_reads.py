"""Bounded reads and metric ingest on Postgres, each against a baseline measured in the same run.

(a) `GET /runs/{id}/metrics?max_points=1000` over a run that stored --series x --steps points
    (default 10 x 100,000 = 1M), of every series and of one (`names=metric_0`), against
    `GET /healthz`; all through the same HTTP client to the same `trainctl serve`,
    interleaved, --reads times each; medians (and p90). Measured
    twice: just after the points were written, and after `VACUUM (ANALYZE) metrics` (what
    autovacuum does to a table soon after a bulk write; until then Postgres reads each row's
    heap page, because it cannot tell yet that the index entry is visible to everyone). For
    scale, the full read of one series (no max_points) is timed too.
(b) Metric ingest as a worker sends it: sequential POSTs of batches of
    contracts.reports.MAX_POINTS_PER_BATCH points to /internal/attempts/{id}/metrics with the
    claim's fencing token, in points/s, by one sender and by several at once (--senders; each
    a worker of its own run, sending its share of the points); against a raw psycopg COPY of
    as many points into the same table, committed.

    .venv/bin/python bench/metrics_reads.py [--series 10] [--steps 100000] [--reads 30]
        [--ingest-points 200000] [--senders 1,2,4]

Needs Postgres (TEST_POSTGRES_URL, default postgresql://postgres@127.0.0.1:5432/test): a
database is created for the run and dropped at the end, with the server it started and its
temporary directory. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

from cli.stack import Proc, free_port, wait_healthy
from contracts.reports import MAX_POINTS_PER_BATCH
from service.auth import create_token
from service.db import make_session_factory, upgrade_database

POSTGRES_ADMIN_URL = os.environ.get(
    "TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MAX_POINTS = 1000


@contextmanager
def database() -> Iterator[str]:
    """A fresh Postgres database, migrated; its psycopg URL. Dropped afterwards."""
    name = f"bench_reads_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = f"{POSTGRES_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    try:
        upgrade_database(url)
        yield url
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextmanager
def server(url: str, tmp: Path) -> Iterator[str]:
    """`trainctl serve` on `url`'s database; its base URL. The broker is never reached: the
    runs here are submitted and claimed by hand, and a failed dispatch only leaves its
    outbox row unsent."""
    (tmp / "data").mkdir()
    port = free_port()
    env = {
        "TRAINCTL_HOME": str(tmp / "home"),
        "TRAINCTL_DATABASE_URL": url,
        "TRAINCTL_BROKER_URL": "redis://127.0.0.1:1/0",
        "TRAINCTL_ARTIFACT_ROOT": str(tmp / "artifacts"),
        "TRAINCTL_DATA_ROOT": str(tmp / "data"),
        "TRAINCTL_LEASE_SECONDS": "3600",
    }
    proc = Proc(["serve", "--port", str(port)], env=env, log=tmp / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base, timeout=90, process=proc.popen)
        except RuntimeError as err:
            sys.exit(f"{err}\n{proc.tail()}")
        yield base
    finally:
        proc.stop()


def workflow(data: Path) -> dict[str, Any]:
    """The smallest valid workflow: the service only hashes its files."""
    (data / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    (data / "text.jsonl").write_text('{"text": "the quick brown fox"}\n')
    return {
        "name": "bench",
        "model": {"config": {"vocab_size": 256, "max_position_embeddings": 128}},
        "tokenizer": "tokenizer.json",
        "microbatch_tokens": 128,
        "phases": [
            {
                "name": "p",
                "objective": "continued_pretrain",
                "data": [{"path": "text.jsonl"}],
                "sequence_length": 64,
                "microbatch_size": 2,
                "steps": 10,
            }
        ],
    }


def points(prefix: str, series: int, steps: int) -> Iterator[tuple[str, int, float]]:
    """Step-major, as a trainer reports them: every series at step 1, then at step 2, ..."""
    for step in range(1, steps + 1):
        for k in range(series):
            yield f"{prefix}{k}", step, 1.0 / step + k


def copy_points(
    url: str, run_id: str, attempt_id: str, rows: list[tuple[str, int, float]]
) -> float:
    """Seconds to COPY `rows` into metrics and commit."""
    with psycopg.connect(url) as conn:
        start = time.perf_counter()
        with (
            conn.cursor() as cur,
            cur.copy("COPY metrics (run_id, name, step, value, attempt_id) FROM STDIN") as copy,
        ):
            for name, step, value in rows:
                copy.write_row((run_id, name, step, value, attempt_id))
        conn.commit()
        return time.perf_counter() - start


def claim(client: httpx.Client, attempt_id: str, worker: dict[str, str]) -> str:
    """Claim the attempt as a worker would; its fencing token."""
    answer = client.post(
        f"/internal/attempts/{attempt_id}/claim",
        json={"hostname": "bench", "pid": os.getpid(), "nonce": uuid.uuid4().hex},
        headers=worker,
    )
    answer.raise_for_status()
    return str(answer.json()["fencing_token"])


def post_concurrently(
    base: str,
    worker: dict[str, str],
    attempts: list[tuple[str, str]],
    batches: list[list[tuple[str, int, float]]],
) -> float:
    """Seconds for one sender per (attempt, fencing token), each with its own connection and
    thread, to post every batch in order to its attempt, as a worker's reporter does. The
    bodies are encoded before the clock starts."""
    barrier = threading.Barrier(len(attempts) + 1)
    failures: list[BaseException] = []

    def send(attempt_id: str, token: str) -> None:
        bodies = [
            json.dumps(
                {
                    "fencing_token": token,
                    "points": [{"name": n, "step": s, "value": v} for n, s, v in batch],
                }
            )
            for batch in batches
        ]
        with httpx.Client(base_url=base, timeout=600) as client:
            barrier.wait()
            try:
                for body, batch in zip(bodies, batches, strict=True):
                    answer = client.post(
                        f"/internal/attempts/{attempt_id}/metrics",
                        content=body,
                        headers={**worker, "Content-Type": "application/json"},
                    )
                    answer.raise_for_status()
                    assert answer.json() == {"accepted": len(batch), "errors": []}, answer.text
            except BaseException as err:  # reported by the main thread
                failures.append(err)

    threads = [threading.Thread(target=send, args=pair) for pair in attempts]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - start


def timed(call: Callable[[], httpx.Response]) -> float:
    start = time.perf_counter()
    response = call()
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed * 1000


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def reads(client: httpx.Client, run_id: str, admin: dict[str, str], n: int) -> dict[str, Any]:
    """/healthz and thinned reads of every series and of one, interleaved; ms (median, p90),
    the points answered, and the median ratio to /healthz."""
    calls: dict[str, tuple[str, dict[str, Any]]] = {
        "healthz": ("/healthz", {}),
        "every series": (f"/runs/{run_id}/metrics", {"max_points": MAX_POINTS}),
        "one series": (
            f"/runs/{run_id}/metrics",
            {"max_points": MAX_POINTS, "names": "metric_0"},
        ),
    }
    times: dict[str, list[float]] = {label: [] for label in calls}
    answered: dict[str, int] = {}
    for _ in range(n):
        for label, (path, params) in calls.items():
            start = time.perf_counter()
            response = client.get(path, params=params, headers=admin)
            times[label].append((time.perf_counter() - start) * 1000)
            response.raise_for_status()
            if label != "healthz":
                columns = response.json().values()
                assert all(len(column["steps"]) <= MAX_POINTS for column in columns)
                answered[label] = sum(len(column["steps"]) for column in columns)
    health = statistics.median(times["healthz"])
    return {
        label: {
            "median": statistics.median(values),
            "p90": p90(values),
            "points": answered.get(label, 0),
            "ratio": statistics.median(values) / health,
        }
        for label, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--series", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=30)
    parser.add_argument("--ingest-points", type=int, default=200_000)
    parser.add_argument(
        "--senders",
        type=lambda text: [int(k) for k in text.split(",")],
        default=[1, 2, 4],
        help="concurrent senders to measure ingest with, each sending its share of the points",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch, database() as url:
        tmp = Path(scratch)
        with make_session_factory(url)() as session:
            admin_token = create_token(session=session, name="bench", role="admin")
            worker_token = create_token(session=session, name="bench", role="worker")
        admin = {"Authorization": f"Bearer {admin_token}"}
        worker = {"Authorization": f"Bearer {worker_token}"}
        with server(url, tmp) as base, httpx.Client(base_url=base, timeout=600) as client:
            doc = workflow(tmp / "data")

            def new_run(name: str) -> tuple[str, str]:
                run = client.post("/runs", json={"workflow": doc, "name": name}, headers=admin)
                run.raise_for_status()
                return run.json()["id"], run.json()["attempts"][0]["id"]

            # (b) ingest over HTTP, by 1, 2, ... concurrent senders (each a worker with its
            # own run and claimed attempt), then COPY of the same number of points.
            ingest: dict[int, tuple[int, float]] = {}
            for senders in args.senders:
                attempts = []
                for k in range(senders):
                    run_id, attempt_id = new_run(f"bench-ingest-{senders}-{k}")
                    attempts.append((attempt_id, claim(client, attempt_id, worker)))
                steps = args.ingest_points // senders // args.series
                sent = list(points("http/", args.series, steps))
                batches = [
                    sent[i : i + MAX_POINTS_PER_BATCH]
                    for i in range(0, len(sent), MAX_POINTS_PER_BATCH)
                ]
                ingest[senders] = (
                    senders * len(sent),
                    post_concurrently(base, worker, attempts, batches),
                )
            n = ingest[args.senders[0]][0]
            copy_seconds = copy_points(
                url, run_id, attempt_id, list(points("copy/", args.series, n // args.series))
            )

            # (a) reads over a run of series x steps points, written by COPY.
            run_id, attempt_id = new_run("bench-reads")
            write_seconds = copy_points(
                url, run_id, attempt_id, list(points("metric_", args.series, args.steps))
            )
            fresh = reads(client, run_id, admin, args.reads)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("VACUUM (ANALYZE) metrics")
            vacuumed = reads(client, run_id, admin, args.reads)
            full = [
                timed(
                    lambda: client.get(
                        f"/runs/{run_id}/metrics", params={"names": "metric_0"}, headers=admin
                    )
                )
                for _ in range(3)
            ]

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
    stored = args.series * args.steps
    print(
        f"{datetime.now(UTC):%Y-%m-%d}, {machine}: {stored:,} points stored ({args.series} x "
        f"{args.steps:,}, written by COPY in {write_seconds:.1f} s), {args.reads} reads each\n"
    )
    print("| table | GET | ms, median (p90) | points answered | / healthz |")
    print("|---|---|---:|---:|---:|")
    for label, measured in (("just written", fresh), ("after VACUUM (ANALYZE)", vacuumed)):
        for call, r in measured.items():
            what = "/healthz" if call == "healthz" else f"max_points={MAX_POINTS}, {call}"
            print(
                f"| {label} | {what} | {r['median']:.1f} ({r['p90']:.1f}) | {r['points']:,} "
                f"| {r['ratio']:.1f}x |"
            )
    print(
        f"\nFull read of one series ({args.steps:,} points, no max_points): median "
        f"{statistics.median(full):.0f} ms of 3.\n"
    )
    copy_rate = n / copy_seconds
    print("| ingest | points | seconds | points/s | / COPY |")
    print("|---|---:|---:|---:|---:|")
    for senders, (sent_points, seconds) in ingest.items():
        rate = sent_points / seconds
        print(
            f"| HTTP, {senders} sender{'s' * (senders > 1)}, batches of {MAX_POINTS_PER_BATCH} "
            f"| {sent_points:,} | {seconds:.2f} | {rate:,.0f} | {rate / copy_rate:.2f}x |"
        )
    print(f"| psycopg COPY | {n:,} | {copy_seconds:.2f} | {copy_rate:,.0f} | 1 |")


if __name__ == "__main__":
    main()
