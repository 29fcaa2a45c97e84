"""One job that is not training (contracts.jobs), start to end: start, run, post the outcome.

This is what the Celery tasks call; it is plain Python, testable without Celery or a broker.
Whatever makes the work fail (a bad file, an unusable tokenizer, a bug) is the job's outcome,
`failed` with a message that says what and where: running it again would fail the same way,
so it is never retried. Only a service that cannot be reached is raised (`ServiceUnavailable`),
for the task to deliver the message again later.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from contracts.jobs import (
    DigestRequest,
    DigestResult,
    EvaluateRequest,
    InspectRequest,
    JobKind,
    JobOutcome,
    PrepareRequest,
    object_fingerprint,
)
from contracts.paths import DataRoots, PathUse
from contracts.signature import sha256_listing
from runtime.store import ArtifactStore, StoreError, is_store_uri, object_at
from worker import metrics
from worker.error import ConfigError, TrainingError, origin
from worker.link.client import ServiceClient
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# contracts.jobs.JobOutcome.error's limit.
MAX_ERROR_CHARS = 4000


def run_job(
    kind: JobKind,
    job_id: str,
    request: dict[str, Any],
    *,
    settings: WorkerSettings,
    client: ServiceClient | None = None,
) -> JobOutcome | None:
    """Start job `job_id`, run it and post its outcome, which is returned; None when the job
    was not this message's to run (it already had an outcome: a message delivered twice) or
    another worker posted its outcome first."""
    own_client = client is None
    client = client or ServiceClient.from_settings(settings)
    try:
        if client.start_job(job_id) is None:
            log.info("%s job %s already has an outcome; dropping the message", kind, job_id)
            return None
        outcome = job_outcome(kind, request, settings=settings)
        metrics.JOBS.labels(kind).inc()
        if outcome.status == "failed":
            log.error("%s job %s failed: %s", kind, job_id, outcome.error)
        if client.finish_job(job_id, outcome) is None:
            log.info("%s job %s got another outcome first; this one is dropped", kind, job_id)
            return None
        return outcome
    finally:
        if own_client:
            client.close()


def job_outcome(kind: JobKind, request: dict[str, Any], *, settings: WorkerSettings) -> JobOutcome:
    """Run the work of a job; its result, or why it failed."""
    try:
        result = _work(kind, request, settings=settings)
    except TrainingError as err:  # DataError, ConfigError: their messages name file and line
        return _failed(str(err))
    except ValidationError as err:
        return _failed(f"the {kind} request does not parse: {err}")
    except MemoryError as err:
        return _failed(f"out of memory: {err}")
    except Exception as err:
        log.exception("%s job failed", kind)
        return _failed(f"{type(err).__name__}: {err} at {origin(err)}")
    dumped = result.model_dump(mode="json")
    try:
        json.dumps(dumped, allow_nan=False)
    except ValueError:
        # JSON cannot carry it, and a job that is never finished would be sent again hourly.
        return _failed(f"the {kind} produced a non-finite number (NaN or infinity): {result!r}")
    return JobOutcome(status="succeeded", result=dumped)


def confine(request: BaseModel, roots: DataRoots) -> None:
    """Each file a job's request names must resolve inside `roots` (contracts.paths), as the
    service checked when it took the request: ConfigError naming the first that does not."""
    fields: list[tuple[str, PathUse]] = [("path", "data"), ("data", "data")]
    fields += [("tokenizer", "data"), ("checkpoint", "checkpoint")]
    for field, use in fields:
        path = getattr(request, field, None)
        if isinstance(path, str) and (why := roots.refusal(path, use)):
            raise ConfigError(f"{field}: {why}")


def fetched(request: BaseModel, settings: WorkerSettings, roots: DataRoots) -> BaseModel:
    """`request` with each of its files named by URI (`s3://`) replaced by its local copy in
    the worker's cache (worker.remote.objects.fetch_input: fetched unless an unchanged copy is
    there). A job has no signed digest to check them against. A checkpoint in the artifact
    store's runs/ is a checkpoint's manifest and saves, not a model directory: it is
    downloaded by its manifest instead (worker.remote.checkpoints) and verified."""
    from worker.checkpoint.layout import local_path, verify_checkpoint
    from worker.remote.cache import Cache
    from worker.remote.checkpoints import RemoteCheckpoints, run_checkpoint
    from worker.remote.objects import fetch_input

    cache = Cache(settings.cache_dir, settings.cache_max_bytes)
    update: dict[str, str] = {}
    for field in ("path", "data", "tokenizer", "checkpoint"):
        value = getattr(request, field, None)
        if not (isinstance(value, str) and is_store_uri(value)):
            continue
        if field == "checkpoint" and (found := run_checkpoint(value)) is not None:
            # A run's checkpoint in the store: its manifest's save, downloaded and verified.
            copy = RemoteCheckpoints(found[0]).fetch(found[1], local_path(value).parent)
            verify_checkpoint(copy)
            update[field] = str(copy)
            continue
        kept = [Path(p) for p in update.values()]  # this job's other inputs stay
        update[field] = str(fetch_input(value, cache=cache, keep=kept))
    return request.model_copy(update=update) if update else request


def _work(kind: JobKind, request: dict[str, Any], *, settings: WorkerSettings) -> BaseModel:
    # Imported here: the work modules load tokenizers and torch, which a job of another kind
    # does not need.
    models: dict[str, type[BaseModel]] = {
        "inspection": InspectRequest,
        "preparation": PrepareRequest,
        "evaluation": EvaluateRequest,
        "digest": DigestRequest,
    }
    parsed = models[kind].model_validate(request)
    if isinstance(parsed, DigestRequest):
        return digest_job(parsed, settings=settings)
    roots = settings.paths()
    confine(parsed, roots)
    # Inputs in an object store are read from their local copies; results name them as asked.
    local = fetched(parsed, settings, roots)
    from worker.remote.tokens import token_stores

    tokens, published = token_stores(settings.artifact_root, settings)
    if isinstance(local, InspectRequest):
        from worker.data.inspect import inspect_file
        from worker.data.store import Stores
        from worker.data.tokenizer import load_tokenizer

        stores = Stores(tokens, load_tokenizer(local.tokenizer), published=published)
        report = inspect_file(local, stores=stores)
        return (
            report.model_copy(update={"path": request["path"]}) if local is not parsed else report
        )
    if isinstance(local, PrepareRequest):
        from worker.data.store import Stores, prepare_file
        from worker.data.tokenizer import load_tokenizer

        stores = Stores(tokens, load_tokenizer(local.tokenizer), published=published)
        prepared = prepare_file(local, stores)
        return prepared.model_copy(update={"path": request["path"]})
    import torch

    from worker.model.model import select_device
    from worker.train.evaluate import evaluate_checkpoint

    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    assert isinstance(local, EvaluateRequest)
    return evaluate_checkpoint(local, device=select_device(settings.device), store_root=tokens)


def _failed(message: str) -> JobOutcome:
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return JobOutcome(status="failed", error=message)


# --- digest ------------------------------------------------------------------------------

# Bytes read per range request while hashing an object.
_DIGEST_CHUNK = 8 * 2**20


def digest_job(request: DigestRequest, *, settings: WorkerSettings) -> DigestResult:
    """The `digest` job: `request.uri` confined to the data roots as any input is (ConfigError
    naming it), then hashed (digest_of_object)."""
    if why := settings.paths().refusal(request.uri, "data"):
        raise ConfigError(f"uri: {why}")
    result = digest_of_object(request.uri)
    if result.fingerprint != request.fingerprint:
        log.info(
            "%s changed since the service looked at it; digest kept for what was read", request.uri
        )
    return result


def digest_of_object(uri: str, progress: Callable[[], None] | None = None) -> DigestResult:
    """The content digest of an object store input, streamed by ranges and never written to
    disk: an object's SHA-256, or for a prefix (every object under `uri/`) the SHA-256 over
    the sorted `relpath\0sha256\n` lines of its objects (contracts.signature.sha256_path's
    rule). The objects are listed first and their ETags checked again after: bytes rewritten
    meanwhile are a ConfigError (hash again), never a digest under the wrong fingerprint.
    `progress` is called after each chunk read. DataError-like failures (gone, access denied)
    are raised as ConfigError naming the URI."""
    try:
        store, key = object_at(uri)
        key = key.rstrip("/")
        entries = _objects(store, key)
        if not entries:
            raise ConfigError(f"no object is at {uri} nor under {uri.rstrip('/')}/")
        digests = {rel: _hash_object(store, full, size, progress) for rel, full, _, size in entries}
        if _objects(store, key) != entries:
            raise ConfigError(f"{uri} changed while it was hashed; hash it again")
    except FileNotFoundError as err:
        raise ConfigError(f"{uri}: {err}") from err
    except StoreError as err:
        raise ConfigError(f"{uri} cannot be read: {err}") from err
    sha = digests[""] if list(digests) == [""] else sha256_listing(digests.items())
    return DigestResult(
        uri=uri,
        sha256=sha,
        fingerprint=object_fingerprint((rel, etag, size) for rel, _, etag, size in entries),
        objects=len(entries),
        size=sum(size for *_, size in entries),
    )


def _objects(store: ArtifactStore, key: str) -> list[tuple[str, str, str, int]]:
    """(relpath, key, ETag, size) of the object at `key` (relpath "") or of those under
    `key/`, sorted; as the service's listing (service.checkpoints.remote.object_entries)."""
    info = store.head(key) if key else None
    if info is not None:
        return [("", key, info.etag, info.size)]
    prefix = f"{key}/" if key else ""
    return sorted((o.key[len(prefix) :], o.key, o.etag, o.size) for o in store.list(key))


def _hash_object(
    store: ArtifactStore, key: str, size: int, progress: Callable[[], None] | None
) -> str:
    digest = hashlib.sha256()
    for start in range(0, size, _DIGEST_CHUNK):
        digest.update(store.get_range(key, start, min(size, start + _DIGEST_CHUNK)))
        if progress is not None:
            progress()
    return digest.hexdigest()
