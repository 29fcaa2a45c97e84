"""Prometheus metrics of the service: `GET /metrics`.

Counts that the database already holds (runs by status, attempts, recoveries) are read from it
at scrape time, so every replica reports the same truth and nothing is lost on a restart.
What only a process sees (request latency, reports ingested) is counted in the process.
Each app has its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.models import ATTEMPT_STATUSES, RUN_STATUSES, Attempt, Job, Run

router = APIRouter(tags=["observability"])

# What a worker posts about an attempt, by the last segment of /internal/attempts/{id}/<kind>.
_REPORTS = ("heartbeat", "metrics", "evals", "checkpoints", "finish", "claim")


class DatabaseCollector(Collector):
    """Gauges, and a counter, read from the database at each scrape."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.session_factory = session_factory

    def collect(self) -> Iterator[Metric]:
        runs = GaugeMetricFamily("trainctl_runs", "Runs by status.", labels=["status"])
        attempts = GaugeMetricFamily("trainctl_attempts", "Attempts by status.", labels=["status"])
        recoveries = GaugeMetricFamily(
            "trainctl_recoveries",
            "Attempts beyond the first of each (run, phase): new attempts after a preemption, "
            "a lost worker, a restart, a pause or a manual resume.",
        )
        jobs = GaugeMetricFamily(
            "trainctl_jobs", "Jobs by kind and status.", labels=["kind", "status"]
        )
        redispatches = CounterMetricFamily(
            "trainctl_attempt_redispatches",
            "Messages of queued attempts sent again because no free worker claimed them (the "
            "broker lost them), over the attempts stored.",
        )
        up = GaugeMetricFamily("trainctl_database_up", "1 when the last scrape read the database.")
        try:
            with self.session_factory() as session:
                # Every status, zero included: a series that vanishes at zero reads as "no
                # data" on a dashboard, and rate() or an alert on it never sees it reach zero.
                run_counts = dict(
                    session.execute(select(Run.status, func.count()).group_by(Run.status)).all()
                )
                attempt_counts = dict(
                    session.execute(
                        select(Attempt.status, func.count()).group_by(Attempt.status)
                    ).all()
                )
                for status in RUN_STATUSES:
                    runs.add_metric([status], run_counts.get(status, 0))
                for status in ATTEMPT_STATUSES:
                    attempts.add_metric([status], attempt_counts.get(status, 0))
                total = session.scalar(select(func.count()).select_from(Attempt)) or 0
                recoveries.add_metric([], total - _distinct_phases(session))
                resent = session.scalar(select(func.sum(Attempt.redispatches))) or 0
                redispatches.add_metric([], resent)
                for kind, status, n in session.execute(
                    select(Job.kind, Job.status, func.count()).group_by(Job.kind, Job.status)
                ):
                    jobs.add_metric([kind, status], n)
            up.add_metric([], 1)
        except SQLAlchemyError:
            up.add_metric([], 0)
            yield up
            return
        yield from (runs, attempts, recoveries, redispatches, jobs, up)


def _distinct_phases(session: Session) -> int:
    """(run, phase) pairs with an attempt (a subquery: SQLite counts no distinct tuples)."""
    pairs = select(Attempt.run_id, Attempt.phase_index).distinct().subquery()
    return session.scalar(select(func.count()).select_from(pairs)) or 0


class Observability:
    """The app's registry and the metrics its middleware updates."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "trainctl_http_request_duration_seconds",
            "Time to answer an HTTP request, by method, route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.reports = Counter(
            "trainctl_reports_ingested",
            "Worker reports taken (2xx), by kind: heartbeat, metrics, evals, checkpoints, "
            "finish, claim.",
            ["kind"],
            registry=self.registry,
        )
        self.registry.register(DatabaseCollector(session_factory))


class MetricsMiddleware:
    """Times each HTTP request and counts worker reports. Plain ASGI (not BaseHTTPMiddleware,
    which would turn the body-limit middleware's 413 into a 400 by wrapping `receive`)."""

    def __init__(self, app: ASGIApp, observability: Observability) -> None:
        self.app = app
        self.observability = observability

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._observe(scope, status, time.perf_counter() - started)

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        route = _route_template(scope)
        # An event stream lasts as long as its watcher; its "latency" would drown the rest.
        if route not in ("/metrics", "/runs/{run_id}/events"):
            self.observability.requests.labels(scope["method"], route, str(status)).observe(seconds)
        kind = route.rsplit("/", 1)[-1]
        if route.startswith("/internal/attempts/") and kind in _REPORTS and status < 300:
            self.observability.reports.labels(kind).inc()


def _route_template(scope: Scope) -> str:
    """`/runs/{run_id}` rather than the concrete path: bounded label values. FastAPI's own
    routes record the route they matched in the scope; the plain Starlette routes FastAPI adds
    (`/openapi.json`, `/docs`, `/redoc`) do not, so those are matched again here, which costs
    a walk of the routes for them and for paths that match nothing."""
    route = scope.get("route")
    if route is None:
        app = scope.get("app")
        for candidate in getattr(getattr(app, "router", None), "routes", ()):
            if isinstance(candidate, Route) and candidate.matches(scope)[0] is Match.FULL:
                route = candidate
                break
    return str(route.path) if route is not None and hasattr(route, "path") else "unmatched"


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus text format; open like /healthz (counts only, no run contents)."""
    from prometheus_client import generate_latest

    registry = request.app.state.observability.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
