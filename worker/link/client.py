"""The worker's HTTP client of the service's `/internal/attempts/{id}/...` and
`/internal/jobs/{id}/...` API."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from contracts.jobs import Job, JobOutcome
from contracts.reports import (
    Accepted,
    CheckpointRegistered,
    CheckpointRemoval,
    CheckpointReport,
    Claim,
    ClaimRequest,
    EvalBatch,
    Finish,
    Heartbeat,
    HeartbeatAnswer,
    MetricBatch,
    MetricPoint,
    metric_batches,
)
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# Error codes of a 409 that mean "this attempt is not yours": drop the work, write nothing.
ALREADY_CLAIMED = "already_claimed"
SUPERSEDED = "superseded"
# A 409 on a job that means "it already has an outcome": drop the message, post nothing.
JOB_FINISHED = "job_finished"

_Answer = TypeVar("_Answer", bound=BaseModel)


class ItemError(BaseModel):
    """A point of a metrics batch the service refused, by its index in the batch."""

    index: int
    error: str


class MetricsAnswer(BaseModel):
    """The metrics route's answer: how many points were stored, and why the others were not."""

    accepted: int
    errors: list[ItemError] = []


class Superseded(Exception):
    """The service gave this attempt to someone else (or cancelled it): stop, write nothing."""


class ServiceError(Exception):
    """The service refused a request."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


class ServiceUnavailable(ServiceError):
    """The service stayed unreachable, or kept answering 5xx, through every retry."""


class WorkerAuth(httpx.Auth):
    """The worker token as the bearer token of each request: read from `file` at each request
    when there is one (a rotation rewrites it; worker.settings), else `token`."""

    def __init__(self, token: str, file: Path | None = None) -> None:
        self._token, self._file = token, file

    def current(self) -> str:
        if self._file is not None:
            try:
                if held := self._file.read_text().strip():
                    return held
            except OSError:
                pass  # e.g. being replaced: the token of the environment until it is back
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.current()}"
        yield request

    @classmethod
    def of(cls, settings: WorkerSettings) -> WorkerAuth:
        return cls(settings.worker_token.get_secret_value(), settings.worker_token_file)


class ServiceClient:
    """Retries only what is transient (connection errors, timeouts, 5xx), a bounded number of
    times with a doubling pause; a 4xx is an answer and is never retried."""

    def __init__(
        self,
        api_url: str,
        token: str | WorkerAuth,
        *,
        timeout_seconds: float = 30.0,
        retries: int = 3,
        backoff_seconds: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=api_url.rstrip("/"),
            auth=token if isinstance(token, WorkerAuth) else WorkerAuth(token),
            timeout=timeout_seconds,
            transport=transport,
        )
        self._retries = retries
        self._backoff_seconds = backoff_seconds

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> ServiceClient:
        return cls(settings.api_url, WorkerAuth.of(settings))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the internal API ------------------------------------------------------------------

    def claim(self, attempt_id: str, request: ClaimRequest) -> Claim | None:
        """The attempt's spec and lease, or None when the message is stale (the attempt is
        already claimed or superseded): messages may be delivered twice, work happens once."""
        try:
            return self._post(f"/internal/attempts/{attempt_id}/claim", request, Claim)
        except Superseded:
            return None
        except ServiceError as err:
            if err.status == 409 and err.code == ALREADY_CLAIMED:
                return None
            raise

    def heartbeat(self, attempt_id: str, heartbeat: Heartbeat) -> HeartbeatAnswer:
        return self._post(f"/internal/attempts/{attempt_id}/heartbeat", heartbeat, HeartbeatAnswer)

    def metrics(
        self, attempt_id: str, *, fencing_token: str, points: Sequence[MetricPoint]
    ) -> MetricsAnswer:
        """Post any number of points, in requests the service takes (`metric_batches`). The
        answer's error indexes are into `points`."""
        accepted, errors, start = 0, [], 0
        for chunk in metric_batches(points):
            batch = MetricBatch(fencing_token=fencing_token, points=chunk)
            answer = self._post(f"/internal/attempts/{attempt_id}/metrics", batch, MetricsAnswer)
            accepted += answer.accepted
            errors += [ItemError(index=start + e.index, error=e.error) for e in answer.errors]
            start += len(chunk)
        return MetricsAnswer(accepted=accepted, errors=errors)

    def evals(self, attempt_id: str, batch: EvalBatch) -> Accepted:
        return self._post(f"/internal/attempts/{attempt_id}/evals", batch, Accepted)

    def checkpoint(self, attempt_id: str, report: CheckpointReport) -> CheckpointRegistered:
        return self._post(
            f"/internal/attempts/{attempt_id}/checkpoints", report, CheckpointRegistered
        )

    def checkpoint_removed(self, attempt_id: str, removal: CheckpointRemoval) -> Accepted:
        return self._post(
            f"/internal/attempts/{attempt_id}/checkpoints/removals", removal, Accepted
        )

    def finish(self, attempt_id: str, finish: Finish) -> Accepted:
        return self._post(f"/internal/attempts/{attempt_id}/finish", finish, Accepted)

    def start_job(self, job_id: str) -> Job | None:
        """Mark the job running; its request comes back. None when it already has an outcome
        (a message delivered twice): drop it."""
        return self._post_job(f"/internal/jobs/{job_id}/start", None)

    def finish_job(self, job_id: str, outcome: JobOutcome) -> Job | None:
        """Post the job's outcome. None when the job already had another one (another worker
        ran the same message): the first outcome is kept."""
        return self._post_job(f"/internal/jobs/{job_id}/result", outcome)

    def _post_job(self, path: str, body: BaseModel | None) -> Job | None:
        """The job, or None when the service answers that it already has an outcome."""
        try:
            return self._post(path, body, Job)
        except ServiceError as err:
            if err.status == 409 and err.code == JOB_FINISHED:
                return None
            raise

    # --- transport -------------------------------------------------------------------------

    def _post(self, path: str, body: BaseModel | None, answer: type[_Answer]) -> _Answer:
        payload = None if body is None else body.model_dump(mode="json")
        for attempt in range(self._retries + 1):
            last_try = attempt == self._retries
            try:
                response = self._http.post(path, json=payload)
            except httpx.TransportError as err:
                if last_try:
                    raise ServiceUnavailable(
                        f"POST {path}: service at {self._http.base_url} unreachable after "
                        f"{attempt + 1} tries: {err!r}"
                    ) from err
                log.warning("POST %s failed (%r); retrying", path, err)
            else:
                if response.status_code < 300:
                    return answer.model_validate(response.json())
                if response.status_code < 500 or last_try:
                    raise _refusal(path, response)
                log.warning("POST %s answered %s; retrying", path, response.status_code)
            time.sleep(self._backoff_seconds * 2**attempt)
        raise AssertionError("unreachable: the last try returns or raises")


def _refusal(path: str, response: httpx.Response) -> Exception:
    code, message, details = None, response.text, None
    try:
        error: Any = response.json()["error"]
        code, message, details = error.get("code"), error.get("message"), error.get("details")
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    if response.status_code == 409 and code == SUPERSEDED:
        return Superseded(f"POST {path}: {message}")
    text = f"POST {path} answered {response.status_code} {code or ''}: {message}"
    if details:
        text += f" ({details})"
    kind = ServiceUnavailable if response.status_code >= 500 else ServiceError
    return kind(text, status=response.status_code, code=code)
