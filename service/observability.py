"""Prometheus metrics of the service: `GET /metrics`.

Counts that the database already holds (runs by status, attempts, recoveries) are read from it
at scrape time, so every replica reports the same truth and nothing is lost on a restart.
What only a process sees (request latency, reports ingested) is counted in the process.
Each app has its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.routing import Match
from starlette.types import ASGIApp

from service.models import Attempt, Job, Run

router = APIRouter(tags=["observability"])

# What a worker posts about an attempt, by the last segment of /internal/attempts/{id}/<kind>.
_REPORTS = ("heartbeat", "metrics", "evals", "checkpoints", "finish", "claim")


class DatabaseCollector(Collector):
    """Gauges read from the database at each scrape."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.session_factory = session_factory

    def collect(self) -> Iterator[GaugeMetricFamily]:
        runs = GaugeMetricFamily("trainctl_runs", "Runs by status.", labels=["status"])
        attempts = GaugeMetricFamily("trainctl_attempts", "Attempts by status.", labels=["status"])
        recoveries = GaugeMetricFamily(
            "trainctl_recoveries",
            "Attempts that continued a phase an earlier attempt of the same run had started "
            "(after a preemption, a lost worker, a restart or a manual resume).",
        )
        jobs = GaugeMetricFamily(
            "trainctl_jobs", "Jobs by kind and status.", labels=["kind", "status"]
        )
        up = GaugeMetricFamily("trainctl_database_up", "1 when the last scrape read the database.")
        try:
            with self.session_factory() as session:
                for status, n in session.execute(
                    select(Run.status, func.count()).group_by(Run.status)
                ):
                    runs.add_metric([status], n)
                for status, n in session.execute(
                    select(Attempt.status, func.count()).group_by(Attempt.status)
                ):
                    attempts.add_metric([status], n)
                total = session.scalar(select(func.count()).select_from(Attempt)) or 0
                recoveries.add_metric([], total - _distinct_phases(session))
                for kind, status, n in session.execute(
                    select(Job.kind, Job.status, func.count()).group_by(Job.kind, Job.status)
                ):
                    jobs.add_metric([kind, status], n)
            up.add_metric([], 1)
        except SQLAlchemyError:
            up.add_metric([], 0)
            yield up
            return
        yield from (runs, attempts, recoveries, jobs, up)


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


class MetricsMiddleware(BaseHTTPMiddleware):
    def __init__(self, app: ASGIApp, observability: Observability) -> None:
        super().__init__(app)
        self.observability = observability

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = _route_template(request)
        # An event stream lasts as long as its watcher; its "latency" would drown the rest.
        if route not in ("/metrics", "/runs/{run_id}/events"):
            self.observability.requests.labels(
                request.method, route, str(response.status_code)
            ).observe(time.perf_counter() - started)
        kind = route.rsplit("/", 1)[-1]
        if (
            route.startswith("/internal/attempts/")
            and kind in _REPORTS
            and response.status_code < 300
        ):
            self.observability.reports.labels(kind).inc()
        return response


def _route_template(request: Request) -> str:
    """`/runs/{run_id}` rather than the concrete path: bounded label values."""
    if (route := request.scope.get("route")) is not None and hasattr(route, "path"):
        return str(route.path)  # set by the router (Starlette >= 0.x) once it matched
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match == Match.FULL:
            return str(getattr(route, "path", request.url.path))
    return "unmatched"


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus text format; open like /healthz (counts only, no run contents)."""
    from prometheus_client import generate_latest

    registry = request.app.state.observability.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
