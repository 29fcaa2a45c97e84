"""What the local tools (`trainctl data inspect|prepare`, `trainctl eval`) share: each runs
here by default, with the worker's own code (so the worker extra must be installed), or on a
worker through the API as a job with `--remote` (paths are then the service's).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.common import EXIT_BAD_INPUT, EXIT_FAILED, call, fail

if TYPE_CHECKING:
    from contracts.jobs import Job


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


def job_result(job: Job, what: str, *, timeout: float) -> Any:
    """A job's result once it finished (Client.wait_for_job). A failed job failed on the file
    or the request: bad input (exit 2), as it is run here; `what` names it in the message."""
    try:
        done = call(lambda api: api.wait_for_job(job, timeout=timeout))
    except TimeoutError as err:
        raise fail(str(err), EXIT_FAILED) from err
    if done.status == "failed":
        raise fail(f"{what} failed: {done.error}", EXIT_BAD_INPUT)
    return done.result


def local(action: Callable[[], Any]) -> Any:
    """Run a worker-side function here, turning its data/config errors into exit code 2."""
    from worker.error import TrainingError

    try:
        return action()
    except TrainingError as err:
        raise fail(str(err), EXIT_BAD_INPUT) from err
