"""What the local tools (`trainctl data inspect|prepare`, `trainctl eval`) share: each runs
here by default, with the worker's own code (so the worker extra must be installed), or on a
worker through the API as a job with `--remote` (paths are then the service's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import EXIT_BAD_INPUT, EXIT_FAILED, call, fail


class Objective(StrEnum):
    continued_pretrain = "continued_pretrain"
    summarization = "summarization"
    instruction_tuning = "instruction_tuning"
    qa_reasoning = "qa_reasoning"
    retrieval_planning = "retrieval_planning"


RemoteOpt = Annotated[
    bool,
    typer.Option(
        "--remote",
        help="Run on a worker through the API (TRAINCTL_API_URL); paths are the service's.",
    ),
]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds to wait for a --remote job.")]


def job_path(path: Path, remote: bool) -> str:
    """A path as the machine that opens it reads it: as given for a worker's (`--remote`, the
    service's paths), absolute for this one's."""
    return str(path) if remote else str(path.resolve())


def local_store_root() -> Path:
    """Where local tools keep token stores: the embedded service's artifact store
    (TRAINCTL_ARTIFACT_ROOT, default ~/.trainctl/artifacts), as its workers do, so a file
    inspected, prepared or evaluated here is not tokenized again by a run."""
    from worker.data.store import store_root
    from worker.settings import WorkerSettings

    return store_root(WorkerSettings().artifact_root)


def local_stores(tokenizer: str) -> Any:
    """The token stores under `local_store_root` of files encoded with `tokenizer`."""
    from worker.data.store import Stores
    from worker.data.tokenizer import load_tokenizer

    return Stores(local_store_root(), load_tokenizer(tokenizer))


def wait_for_job(path: str, *, timeout: float, poll: float = 0.5) -> dict[str, Any]:
    """Poll a job (`/datasets/inspections/<id>`, `/datasets/preparations/<id>`,
    `/evaluations/<id>`) until it finishes."""
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = call("GET", path)
        if job["status"] in ("succeeded", "failed"):
            return job
        if time.monotonic() > deadline:
            raise fail(f"{path} still {job['status']} after {timeout:.0f} s", EXIT_FAILED)
        time.sleep(poll)


def job_result(path: str, what: str, *, timeout: float) -> Any:
    """A job's result once it finished (`wait_for_job`). A failed job failed on the file or the
    request: bad input (exit 2), as it is run here; `what` names it in the message."""
    job = wait_for_job(path, timeout=timeout)
    if job["status"] == "failed":
        raise fail(f"{what} failed: {job.get('error')}", EXIT_BAD_INPUT)
    return job["result"]


def local(action: Callable[[], Any]) -> Any:
    """Run a worker-side function here, turning its data/config errors into exit code 2."""
    from worker.error import TrainingError

    try:
        return action()
    except TrainingError as err:
        raise fail(str(err), EXIT_BAD_INPUT) from err
