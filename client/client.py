"""`Client`: a method for each thing a user does with trainctl, each answering with the model
the service answers with. Synchronous; one httpx connection pool per client (use it as a
context manager, or call close())."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from client.events import Event, parse_events
from client.http import Http
from contracts.api import (
    MAX_RUNS_PAGE,
    CheckpointsPublic,
    EvalByPhase,
    EvalSummaryPublic,
    LedgerPublic,
    MetricSeriesPublic,
    QueuePublic,
    RunComparison,
    RunPublic,
    RunsPublic,
    TokenIssued,
    TokenPublic,
    TokenRole,
    TokensPublic,
    WhoAmI,
    WorkersPublic,
    WorkflowPublic,
    WorkflowValidation,
)
from contracts.jobs import EvaluateRequest, InspectRequest, Job, JobKind, PrepareRequest

# Where each CSV export is read; `{run_id}` is filled in.
METRICS_CSV_URL = "/runs/{run_id}/metrics.csv"
EVAL_CSV_URL = "/runs/{run_id}/eval.csv"

# Where each kind of job is read back (its 202's Location is `<path>/<id>`).
JOB_PATHS: dict[str, str] = {
    "inspection": "/datasets/inspections",
    "preparation": "/datasets/preparations",
    "evaluation": "/evaluations",
}
# A run is finished in these; a paused one waits for someone's resume, so waiting stops too.
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
STOPPED = FINISHED | {"paused"}

Workflow = Mapping[str, Any] | Path


def read_workflow(path: Path) -> dict[str, Any]:
    """A workflow file, with its relative paths resolved against the file's own folder (as
    `trainctl runs create FILE` sends it). Raises OSError, or ValueError: invalid JSON
    (json.JSONDecodeError), undecodable bytes, or JSON that is not an object."""
    from runtime.path import resolve_paths

    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a workflow must be a JSON object")
    return resolve_paths(doc, path.resolve().parent)


def _document(workflow: Workflow) -> dict[str, Any]:
    return read_workflow(workflow) if isinstance(workflow, Path) else dict(workflow)


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


class Client:
    """trainctl's public API at `base_url` (e.g. http://127.0.0.1:8600) with a bearer `token`.
    Every error answer raises client.ApiError with its status, code, message and details."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 30.0) -> None:
        self.http = Http(base_url, token, timeout=timeout)

    @classmethod
    def from_env(cls) -> Client:
        """As the CLI connects: TRAINCTL_API_URL (default http://127.0.0.1:8600), and
        TRAINCTL_TOKEN, else the embedded stack's token file ($TRAINCTL_HOME/token, default
        ~/.trainctl/token)."""
        token = os.environ.get("TRAINCTL_TOKEN", "")
        if not token:
            home = Path(os.environ.get("TRAINCTL_HOME") or Path.home() / ".trainctl")
            path = home / "token"
            token = path.read_text().strip() if path.exists() else ""
        return cls(os.environ.get("TRAINCTL_API_URL", "http://127.0.0.1:8600"), token)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # --- workflows ---------------------------------------------------------------------------

    def validate_workflow(self, workflow: Workflow) -> WorkflowValidation:
        """The plan of a valid workflow (a document, or a file); 422 `invalid_workflow` lists
        every problem with its JSON path."""
        answer = self.http.request("POST", "/workflows/validate", json=_document(workflow))
        return WorkflowValidation.model_validate(answer)

    def create_workflow(self, workflow: Workflow) -> WorkflowPublic:
        """Store a workflow; the same document again answers the same id."""
        answer = self.http.request("POST", "/workflows", json=_document(workflow))
        return WorkflowPublic.model_validate(answer)

    def get_workflow(self, workflow_id: str) -> WorkflowPublic:
        return WorkflowPublic.model_validate(self.http.request("GET", f"/workflows/{workflow_id}"))

    # --- runs --------------------------------------------------------------------------------

    def create_run(
        self,
        workflow: Workflow | None = None,
        *,
        workflow_id: str | None = None,
        name: str | None = None,
        initial_checkpoint: str | Mapping[str, Any] | None = None,
        max_restarts: int | None = None,
        max_preemptions: int | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> RunPublic:
        """A new run of `workflow` (a document, or a file whose relative paths are resolved
        against its folder) or of a stored `workflow_id`. `initial_checkpoint`: a path the
        service reads, or `{"run", "step"}` / `{"run", "best"}`. The same `idempotency_key`
        and body again answer the same run."""
        body = _given(
            workflow=None if workflow is None else _document(workflow),
            workflow_id=workflow_id,
            name=name,
            initial_checkpoint=initial_checkpoint,
            max_restarts=max_restarts,
            max_preemptions=max_preemptions,
            priority=priority,
        )
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return RunPublic.model_validate(
            self.http.request("POST", "/runs", json=body, headers=headers)
        )

    def get_run(self, run_id: str) -> RunPublic:
        return RunPublic.model_validate(self.http.request("GET", f"/runs/{run_id}"))

    def list_runs(
        self,
        *,
        status: str | None = None,
        tags: Sequence[str] | None = None,
        name: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunsPublic:
        """One page of runs, newest first; pass its `next_cursor` (and the same filters) as
        `cursor` for the next. `tags`: runs carrying every one."""
        params = _given(status=status, tag=list(tags) if tags else None, name=name or None)
        params |= _given(limit=limit, cursor=cursor)
        return RunsPublic.model_validate(self.http.request("GET", "/runs", params=params))

    def iter_runs(
        self,
        *,
        status: str | None = None,
        tags: Sequence[str] | None = None,
        name: str | None = None,
    ) -> Iterator[RunPublic]:
        """Every run matching the filters, newest first, a page at a time."""
        cursor = None
        while True:
            page = self.list_runs(
                status=status, tags=tags, name=name, limit=MAX_RUNS_PAGE, cursor=cursor
            )
            yield from page.runs
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def update_run(
        self,
        run_id: str,
        *,
        name: str | None = None,
        tags: Sequence[str] | None = None,
        note: str | None = None,
        priority: int | None = None,
    ) -> RunPublic:
        """Set the run's name, tags (the whole set; `[]` removes every tag), note (`""`
        removes it) or placement priority; what is None stays."""
        body = _given(
            name=name, tags=None if tags is None else list(tags), note=note, priority=priority
        )
        return RunPublic.model_validate(self.http.request("PATCH", f"/runs/{run_id}", json=body))

    def pause_run(self, run_id: str) -> RunPublic:
        """Ask the worker to checkpoint and stop; resume_run continues from there."""
        return RunPublic.model_validate(self.http.request("POST", f"/runs/{run_id}/pause"))

    def resume_run(
        self,
        run_id: str,
        *,
        workflow: Workflow | None = None,
        initial_checkpoint: str | Mapping[str, Any] | None = None,
        devices: int | None = None,
    ) -> RunPublic:
        """Continue the run from its latest checkpoint; what is given must reproduce its
        signature (409 `signature_mismatch` names each differing field)."""
        body = _given(
            workflow=None if workflow is None else _document(workflow),
            initial_checkpoint=initial_checkpoint,
            devices=devices,
        )
        answer = self.http.request("POST", f"/runs/{run_id}/resume", json=body)
        return RunPublic.model_validate(answer)

    def cancel_run(self, run_id: str) -> RunPublic:
        return RunPublic.model_validate(self.http.request("POST", f"/runs/{run_id}/cancel"))

    def wait_for_run(self, run_id: str, *, timeout: float, poll: float = 1.0) -> RunPublic:
        """The run once it has finished (succeeded, failed, cancelled) or paused, read every
        `poll` seconds; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.get_run(run_id)
            if run.status in STOPPED:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run.status} after {timeout:.0f} s")
            time.sleep(poll)

    # --- a run's results ---------------------------------------------------------------------

    def eval(self, run_id: str, *, max_points: int | None = None) -> EvalSummaryPublic:
        """Per eval set: baseline, latest, best, history (thinned to `max_points`)."""
        params = _given(max_points=max_points)
        answer = self.http.request("GET", f"/runs/{run_id}/eval", params=params)
        return EvalSummaryPublic.model_validate(answer)

    def eval_by_phase(self, run_id: str) -> EvalByPhase:
        """Each eval set at each phase's end and its change over the phase (forgetting)."""
        return EvalByPhase.model_validate(self.http.request("GET", f"/runs/{run_id}/eval/phases"))

    def metrics(
        self, run_id: str, *, names: Sequence[str] | None = None, max_points: int | None = None
    ) -> MetricSeriesPublic:
        """Each metric series as columns; `names` default: what workers report every step."""
        params = _given(names=",".join(names) if names else None, max_points=max_points)
        answer = self.http.request("GET", f"/runs/{run_id}/metrics", params=params)
        return MetricSeriesPublic.model_validate(answer)

    def download_metrics_csv(
        self,
        run_id: str,
        dest: Path,
        *,
        names: Sequence[str] | None = None,
        max_points: int | None = None,
    ) -> Path:
        """Write the run's metric points to `dest` as CSV (run_id,name,step,value)."""
        params = _given(names=",".join(names) if names else None, max_points=max_points)
        return self._download(METRICS_CSV_URL.format(run_id=run_id), dest, params)

    def download_eval_csv(self, run_id: str, dest: Path) -> Path:
        """Write the run's evaluations to `dest` as CSV, a row per eval set and step."""
        return self._download(EVAL_CSV_URL.format(run_id=run_id), dest, {})

    def _download(self, url: str, dest: Path, params: dict[str, Any]) -> Path:
        self.http.download(url, dest, params=params)
        return dest

    def checkpoints(self, run_id: str, *, status: str = "usable") -> CheckpointsPublic:
        """The run's checkpoints (`usable`, `deleted`, `quarantined` or `all`) and each eval
        set's best one."""
        answer = self.http.request("GET", f"/runs/{run_id}/checkpoints", params={"status": status})
        return CheckpointsPublic.model_validate(answer)

    def ledger(self, run_id: str) -> LedgerPublic:
        return LedgerPublic.model_validate(self.http.request("GET", f"/runs/{run_id}/ledger"))

    def compare(self, run_ids: Sequence[str]) -> RunComparison:
        """Two or more runs side by side; the first is the reference."""
        answer = self.http.request("GET", "/runs/compare", params={"ids": ",".join(run_ids)})
        return RunComparison.model_validate(answer)

    def events(
        self,
        run_id: str,
        *,
        names: Sequence[str] | None = None,
        metrics_after: int = -1,
        evals_after: int = -1,
    ) -> Iterator[Event]:
        """The run's server-sent events as they come, until the stream ends (after `end`, or
        an `error`). Leave the loop early to close the stream."""
        params = _given(names=",".join(names) if names else None)
        params |= {"metrics_after": metrics_after, "evals_after": evals_after}
        yield from parse_events(self.http.lines(f"/runs/{run_id}/events", params=params))

    # --- jobs --------------------------------------------------------------------------------

    def inspect_dataset(self, request: InspectRequest) -> Job:
        """Queue an inspection of a data file on a worker (paths are the service's)."""
        return self._job("/datasets/inspect", request)

    def prepare_dataset(self, request: PrepareRequest) -> Job:
        """Queue building a data file's token store on a worker."""
        return self._job("/datasets/prepare", request)

    def evaluate(self, request: EvaluateRequest) -> Job:
        """Queue an evaluation of a checkpoint on one task's data, outside any run."""
        return self._job("/evaluations", request)

    def get_job(self, kind: JobKind, job_id: str) -> Job:
        return Job.model_validate(self.http.request("GET", f"{JOB_PATHS[kind]}/{job_id}"))

    def wait_for_job(self, job: Job, *, timeout: float, poll: float = 0.5) -> Job:
        """The job once it has succeeded or failed; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while job.status not in ("succeeded", "failed"):
            if time.monotonic() > deadline:
                path = f"{JOB_PATHS[job.kind]}/{job.id}"
                raise TimeoutError(f"{path} still {job.status} after {timeout:.0f} s")
            time.sleep(poll)
            job = self.get_job(job.kind, job.id)
        return job

    def _job(self, path: str, request: InspectRequest | PrepareRequest | EvaluateRequest) -> Job:
        return Job.model_validate(self.http.request("POST", path, json=request.model_dump()))

    # --- workers and tokens ------------------------------------------------------------------

    def workers(self, *, limit: int = 100) -> WorkersPublic:
        """The workers the service has heard from, most recent first."""
        return WorkersPublic.model_validate(
            self.http.request("GET", "/workers", params={"limit": limit})
        )

    def queue(self, *, limit: int = 100) -> QueuePublic:
        """Queued attempts in placement order, each with why it waits."""
        return QueuePublic.model_validate(
            self.http.request("GET", "/queue", params={"limit": limit})
        )

    def whoami(self) -> WhoAmI:
        """This client's token: its id, name, role and what the role may do."""
        return WhoAmI.model_validate(self.http.request("GET", "/whoami"))

    def tokens(self, *, revoked: bool = False) -> TokensPublic:
        """Every token (admin only), without secrets; `revoked` lists revoked ones too."""
        answer = self.http.request("GET", "/tokens", params={"revoked": revoked})
        return TokensPublic.model_validate(answer)

    def create_token(
        self, name: str, *, role: TokenRole = "user", max_devices: int | None = None
    ) -> TokenIssued:
        """A new token (admin only); its secret is in this answer only. `max_devices`: the
        most devices its runs hold at once (None: unlimited)."""
        body = _given(name=name, role=role, max_devices=max_devices)
        answer = self.http.request("POST", "/tokens", json=body)
        return TokenIssued.model_validate(answer)

    def set_max_devices(self, token_id: str, max_devices: int | None) -> TokenPublic:
        """Set the token's device quota (admin only); None removes it."""
        answer = self.http.request(
            "PATCH", f"/tokens/{token_id}", json={"max_devices": max_devices}
        )
        return TokenPublic.model_validate(answer)

    def revoke_token(self, token_id: str) -> TokenPublic:
        return TokenPublic.model_validate(self.http.request("DELETE", f"/tokens/{token_id}"))

    def rotate_token(self, token_id: str) -> TokenIssued:
        """A new secret for the token; the old one is refused from the next request on."""
        answer = self.http.request("POST", f"/tokens/{token_id}/rotate")
        return TokenIssued.model_validate(answer)
