"""The launchers: `serve` (the API alone), `worker` (one worker process), `up` (the embedded
stack: the API on SQLite and its worker processes) and `demo` (that stack running the demo
workflow). Each imports the side it starts inside its own body."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.common import EXIT_BAD_INPUT, EXIT_FAILED, err_console, fail, load_workflow
from cli.config import get_settings

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEMO_WORKFLOW = EXAMPLES / "workflows" / "demo.json"


def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8600,
) -> None:
    """Run the API alone, with settings from TRAINCTL_* (Postgres and Redis in production)."""
    import uvicorn

    from runtime.logs import configure_logging
    from service.api.app import create_app
    from service.db import upgrade_database
    from service.settings import ServiceSettings

    settings = ServiceSettings()
    configure_logging(settings.log_format, settings.log_level)
    upgrade_database(settings.database_url)
    uvicorn.run(create_app(settings), host=host, port=port, log_config=None, log_level="warning")


def worker() -> None:
    """Run one worker process (one training slot) on TRAINCTL_BROKER_URL, reporting to
    TRAINCTL_API_URL."""
    from worker.process.celery_app import start_worker
    from worker.settings import get_settings as worker_settings

    start_worker(worker_settings())


def up(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8600,
    workers: Annotated[int, typer.Option(min=0, help="Worker processes to start.")] = 1,
) -> None:
    """Run the embedded stack: the API on SQLite plus worker processes over a broker folder.
    A worker that exits is started again (after 1 s, doubling up to 60 s while it keeps
    exiting); each restart is logged and counted in /metrics (trainctl_worker_restarts_total).

    The first start writes an admin token to <home>/token (TRAINCTL_HOME, default
    ~/.trainctl; mode 0600), which the CLI reads. Rotating it, or the workers' token in
    <home>/worker-token, rewrites the file: nothing needs a restart."""
    import uvicorn
    from prometheus_client import Counter

    from cli.stack import Supervisor, spawn, stop
    from runtime.logs import configure_logging
    from service.api.app import create_app
    from service.auth import WORKER_TOKEN_FILE, ensure_tokens
    from service.db import upgrade_database
    from service.settings import ServiceSettings

    settings = ServiceSettings(api_url=f"http://{host}:{port}")
    configure_logging(settings.log_format, settings.log_level)
    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade_database(settings.database_url)
    tokens = ensure_tokens(settings)
    env = {
        "TRAINCTL_HOME": str(settings.home),
        "TRAINCTL_API_URL": settings.api_url,
        "TRAINCTL_BROKER_URL": settings.broker_url,
        "TRAINCTL_QUEUE": settings.queue,
        "TRAINCTL_WORKER_TOKEN": tokens.worker,
        # Read at each request: rotating the embedded worker's token rewrites this file.
        "TRAINCTL_WORKER_TOKEN_FILE": str(settings.home / WORKER_TOKEN_FILE),
    }
    logs = settings.home / "logs"
    logs.mkdir(exist_ok=True)
    api = create_app(settings)
    restarts = Counter(
        "trainctl_worker_restarts",
        "Worker processes `trainctl up` started again after they exited.",
        registry=api.state.observability.registry,
    )
    # uvicorn handles SIGTERM itself, then raises it again once shut down, which by default
    # kills this process before the workers (in their own sessions) are stopped. A handler
    # that exits instead lets the `finally` below stop them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    supervisor = Supervisor(
        lambda i: spawn(["worker"], env=env, log=logs / f"worker-{i}.log"),
        workers,
        stop_child=stop,
        on_restart=restarts.inc,
    )
    try:
        supervisor.watch()
        err_console.print(
            f"trainctl up: API {settings.api_url}, {workers} worker(s), home {settings.home}, "
            f"token in {settings.home / 'token'}"
        )
        uvicorn.run(api, host=host, port=port, log_config=None, log_level="warning")
    finally:
        supervisor.close()


def demo(
    workflow: Annotated[Path, typer.Option(help="Workflow to run.")] = DEMO_WORKFLOW,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each run.")] = 900,
) -> None:
    """Start the embedded stack, run the demo workflow, and print baseline vs final perplexity
    per task. Fails (exit 1) unless the loss fell in every phase and every task improved.

    A post-training workflow (no pretraining phase first, no pretrained model) of the demo's
    model and tokenizer starts from the final checkpoint of the demo workflow's run in
    $TRAINCTL_HOME, which is trained first when there is none."""
    from cli.demo import fits_start, needs_start, run_demo

    doc, start = load_workflow(workflow), None
    if needs_start(doc):
        start = load_workflow(DEMO_WORKFLOW)
        if not fits_start(doc, start):
            raise fail(
                f"{workflow} trains no pretraining phase first, so it needs a checkpoint to "
                f"start from, and its model or tokenizer is not the demo's ({DEMO_WORKFLOW}); "
                "run it with `trainctl up` and `trainctl runs create "
                f"{workflow} --initial-checkpoint CHECKPOINT`",
                EXIT_BAD_INPUT,
            )
    result = run_demo(doc, home=get_settings().home, timeout=timeout, start=start)
    raise typer.Exit(0 if result.ok else EXIT_FAILED)
