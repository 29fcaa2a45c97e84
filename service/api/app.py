"""The app factory. Run it with `uvicorn --factory service.api.app:create_app` (settings from the
environment); `uvicorn service.api.app:app` works too and builds the app on first access."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from service.api import observability
from service.api.error_response import install_error_handlers
from service.api.middleware import RefuseNul, RequestBodyLimit
from service.api.observability import MetricsMiddleware, Observability
from service.api.routes import (
    audit,
    dashboard,
    events,
    health,
    internal,
    jobs,
    runs,
    tokens,
    workers,
    workflows,
)
from service.db import make_engine, make_session_factory
from service.settings import ServiceSettings
from service.workers.dispatch import OutboxPump, make_celery
from service.workers.reaper import Reaper


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    """The API over `settings` (read from the environment when not given). The database must
    already be at the latest revision (service.db.upgrade_database)."""
    settings = settings or ServiceSettings()
    engine = make_engine(settings.database_url)
    session_factory = make_session_factory(engine)
    pump = OutboxPump(
        session_factory=session_factory,
        celery=make_celery(settings.broker_url),
        queue=settings.queue,
        interval=settings.outbox_interval_seconds,
        lease_seconds=settings.lease_seconds,
    )
    reaper = Reaper(
        session_factory=session_factory,
        dispatch=pump.dispatch,
        interval=settings.reaper_interval_seconds,
        lease_seconds=settings.lease_seconds,
        stall_seconds=settings.stall_seconds,
        job_timeout=settings.job_timeout_seconds,
        job_max_deliveries=settings.job_max_deliveries,
        redispatch_seconds=settings.redispatch_seconds,
        queue=settings.queue,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        pump.start()
        reaper.start()
        try:
            yield
        finally:
            reaper.stop()
            pump.close()
            engine.dispose()

    app = FastAPI(
        title="trainctl",
        summary="Training control: workflows, runs, attempts, metrics and evaluations",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory
    app.state.pump = pump
    app.state.reaper = reaper
    app.state.observability = Observability(session_factory)
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, observability=app.state.observability)
    app.add_middleware(RequestBodyLimit)
    app.add_middleware(
        RequestBodyLimit,
        prefix=internal.PREFIX,
        max_bytes=internal.MAX_BODY_BYTES,
        message=internal.too_large,
    )
    app.add_middleware(RefuseNul)
    for module in (
        health,
        workflows,
        runs,
        jobs,
        events,
        workers,
        internal,
        observability,
        tokens,
        audit,
        dashboard,
    ):
        app.include_router(module.router)
    app.include_router(workers.internal_router)
    app.include_router(workers.queue_router)
    app.mount(dashboard.STATIC_PATH, dashboard.static_files(), name="static")
    return app


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    # `service.api.app:app` for uvicorn without the --factory flag, built only when asked for.
    global _app
    if name == "app":
        if _app is None:
            _app = create_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
