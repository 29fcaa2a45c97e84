"""Content digests of a run's inputs. The service only hashes files; it never reads them, and it
never downloads an object.

A local path is hashed here, through the one cache both sides use (runtime/digest.py), so
resubmitting a workflow over unchanged files costs stats. Hashing a corpus takes seconds per
GiB.

An `s3://` input (an object: a file; or a prefix: a directory, every object under `uri/`) keeps
the same identity, its content's SHA-256 by contracts.signature.sha256_path's rule, but its
bytes are read by a worker: the service HEADs or lists it (cheap), fingerprints what it sees
(contracts.jobs.object_fingerprint: keys, ETags, sizes) and looks the digest up in
`input_digests`. An unknown one becomes a `digest` job (service.workers.job), whose outcome
records it there. Run creation waits for those jobs up to TRAINCTL_DIGEST_WAIT_SECONDS, then
answers 409 `inputs_being_hashed` naming each input and its job, to be sent again; a job that
failed (the object gone, access denied) is 422 `missing_input` naming the input, and the next
request asks again. A checkpoint in the object store's runs/ is no such input: its manifest
says its digest (service.checkpoints.remote.remote_checkpoint_digest), one small GET.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import update
from sqlalchemy.orm import Session

from contracts.jobs import DigestRequest
from contracts.paths import DataRoots
from contracts.signature import Digests
from contracts.workflow import Workflow as WorkflowSpec
from runtime.digest import digest_path
from runtime.store import StoreError, is_store_uri
from service.checkpoints.remote import fingerprint_of, remote_checkpoint_digest
from service.db import insert_for
from service.errors import ApiError
from service.models import InputDigest, Job, OutboxMessage, new_job_id, utcnow

log = logging.getLogger(__name__)

# How often a waiting request looks at its digest jobs again.
_POLL_SECONDS = 0.25
_PENDING = ("queued", "running")


@dataclass(frozen=True)
class DigestJobs:
    """How a request gets the digests of object store inputs: `wait` seconds at most for
    digest jobs (TRAINCTL_DIGEST_WAIT_SECONDS), `dispatch` called (in a thread) after it
    stores new ones so their messages go out now rather than at the outbox's next pass."""

    wait: float = 0.0
    dispatch: Callable[[], object] | None = None


@dataclass(frozen=True)
class _Input:
    field: str
    uri: str
    fingerprint: str


def resolve_digests(
    workflow: WorkflowSpec,
    *,
    initial_checkpoint: str | None,
    session: Session | None = None,
    roots: DataRoots | None = None,
    jobs: DigestJobs | None = None,
) -> Digests:
    """Digests of every external input; 422 `missing_input` naming each one that is gone. An
    object store input needs `session` (its digest is looked up, or asked of a worker, as the
    module says: 409 `inputs_being_hashed` while one is hashed past `jobs.wait`); one in the
    object store's runs/ of `roots` is a checkpoint, digested from its manifest. Call with no
    transaction worth keeping open: each look at the database ends its own."""
    problems: list[dict[str, str]] = []
    remote: list[_Input] = []
    roots_in_runs = roots.in_runs if roots is not None else (lambda _: None)

    def digest(field: str, path: str) -> str:
        if is_store_uri(path):
            try:
                if roots_in_runs(path) is not None:
                    return remote_checkpoint_digest(path)
                remote.append(_Input(field, path, fingerprint_of(path)))
            except (OSError, ValueError, StoreError) as err:  # gone, refused, no checkpoint
                problems.append({"path": field, "message": f"cannot read {path}: {err}"})
            return ""
        try:
            return digest_path(path)
        except (OSError, ValueError) as err:  # gone, unreadable, a NUL byte, a name too long
            problems.append({"path": field, "message": f"cannot read {path}: {err}"})
            return ""

    tokenizer = digest("tokenizer", workflow.tokenizer)
    data = {path: digest(f'data["{path}"]', path) for path in workflow.data_paths()}
    pretrained = (
        None
        if workflow.model.pretrained is None
        else digest("model.pretrained", workflow.model.pretrained)
    )
    checkpoint = (
        None if initial_checkpoint is None else digest("initial_checkpoint", initial_checkpoint)
    )
    if problems:
        raise _missing(problems)
    if remote:
        if session is None:
            raise ValueError("object store inputs are digested through the database: pass session")
        found = _await_digests(session, remote, jobs or DigestJobs())
        by_uri = {item.uri: found[item] for item in remote}
        tokenizer = by_uri.get(workflow.tokenizer, tokenizer)
        data = {path: by_uri.get(path, sha) for path, sha in data.items()}
        if workflow.model.pretrained is not None:
            pretrained = by_uri.get(workflow.model.pretrained, pretrained)
        if initial_checkpoint is not None:
            checkpoint = by_uri.get(initial_checkpoint, checkpoint)
    return Digests(
        tokenizer=tokenizer, data=data, initial_checkpoint=checkpoint, pretrained=pretrained
    )


def _missing(problems: list[dict[str, str]]) -> ApiError:
    return ApiError(
        422,
        "missing_input",
        "cannot hash the run's inputs: "
        + "; ".join(f"{p['path']}: {p['message']}" for p in problems)
        + "; check that the service can read these paths (relative paths resolve against "
        "TRAINCTL_DATA_ROOT) and, for s3:// inputs, that the objects exist and the service's "
        "and workers' credentials may read them",
        problems,
    )


# --- digest jobs ---------------------------------------------------------------------------


def _await_digests(session: Session, inputs: list[_Input], jobs: DigestJobs) -> dict[_Input, str]:
    """The digest of every input, asking a worker for each unknown one and waiting for them up
    to `jobs.wait` seconds (polling, with no transaction open in between)."""
    deadline = time.monotonic() + jobs.wait
    while True:
        found: dict[_Input, str] = {}
        pending: list[tuple[_Input, str]] = []
        failed: list[dict[str, str]] = []
        created = False
        for item in dict.fromkeys(inputs):
            state, value, new = _digest_state(session, item)
            created = created or new
            if state == "done":
                found[item] = value
            elif state == "pending":
                pending.append((item, value))
            else:
                failed.append(
                    {
                        "path": item.field,
                        "message": f"cannot read {item.uri}: {value}",
                        "uri": item.uri,
                    }
                )
        if created and jobs.dispatch is not None:
            # A slow broker delays the messages, never the request (the outbox resends them).
            threading.Thread(target=jobs.dispatch, name="digest-dispatch", daemon=True).start()
        if failed:
            raise _missing(failed)
        if not pending:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            raise _being_hashed(pending)
        time.sleep(min(_POLL_SECONDS, left))


def _being_hashed(pending: list[tuple[_Input, str]]) -> ApiError:
    named = [{"field": item.field, "uri": item.uri, "job_id": job} for item, job in pending]
    return ApiError(
        409,
        "inputs_being_hashed",
        "a worker is hashing the run's object store inputs ("
        + "; ".join(f"{n['field']}: {n['uri']} (job {n['job_id']})" for n in named)
        + "); send the same request again shortly: it then finds their digests (raise "
        "TRAINCTL_DIGEST_WAIT_SECONDS to wait longer in one request; is a worker running?)",
        {"inputs": named},
    )


def _digest_state(session: Session, item: _Input) -> tuple[str, str, bool]:
    """("done", sha256) | ("pending", job id) | ("failed", why), and whether a job was made
    now. A failed job's row is dropped, so that the next request asks again (the operator may
    have fixed the object or the credentials). Commits or rolls back before returning."""
    try:
        for _ in range(5):  # a concurrent request may take the row first: look again
            key = (item.uri, item.fingerprint)
            row = session.get(InputDigest, key, populate_existing=True)
            if row is not None and row.sha256 is not None:
                return "done", row.sha256, False
            job = (
                None
                if row is None or row.job_id is None
                else session.get(Job, row.job_id, populate_existing=True)
            )
            if job is not None and job.status in _PENDING:
                return "pending", job.id, False
            if job is not None and job.status == "failed":
                why = job.error or "the digest job failed"
                session.delete(row)
                session.commit()
                return "failed", f"{why} (digest job {job.id})", False
            # None yet, or its job is gone or hashed other bytes (the object changed meanwhile).
            made = _ask(session, item, None if row is None else (row.job_id or ""))
            if made is not None:
                return "pending", made, True
            session.rollback()
        raise ApiError(
            409,
            "inputs_being_hashed",
            f"{item.field}: {item.uri} is being asked for by concurrent requests; send the "
            "request again",
            {"inputs": [{"field": item.field, "uri": item.uri, "job_id": None}]},
        )
    finally:
        session.rollback()


def _ask(session: Session, item: _Input, previous: str | None) -> str | None:
    """Store a digest job for `item` with its outbox row and point the row at it (a new row
    when `previous` is None, else the row whose job was `previous`, "" for none), and commit;
    the job's id, or None when a concurrent request changed the row first."""
    request = DigestRequest(uri=item.uri, fingerprint=item.fingerprint)
    job = Job(id=new_job_id(), kind="digest", status="queued", request=request.model_dump())
    session.add(job)
    session.flush()
    session.add(OutboxMessage(job_id=job.id))
    if previous is None:
        won = session.execute(
            insert_for(session, InputDigest)
            .values(uri=item.uri, fingerprint=item.fingerprint, job_id=job.id, created_at=utcnow())
            .on_conflict_do_nothing(index_elements=["uri", "fingerprint"])
            .returning(InputDigest.uri)
        ).first()
    else:
        same = InputDigest.job_id.is_(None) if not previous else InputDigest.job_id == previous
        won = session.execute(
            update(InputDigest)
            .where(
                InputDigest.uri == item.uri,
                InputDigest.fingerprint == item.fingerprint,
                InputDigest.sha256.is_(None),
                same,
            )
            .values(job_id=job.id)
            .returning(InputDigest.uri)
            .execution_options(synchronize_session=False)
        ).first()
    if won is None:
        session.rollback()
        return None
    session.commit()
    log.info("digest job %s asked for %s: %s", job.id, item.field, item.uri)
    return job.id
