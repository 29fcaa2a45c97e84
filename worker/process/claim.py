"""The claim: what this process asks the service for (`claim_request`), and the checks of what
a claim hands it before anything trains: the workflow parses, the encoder is the run's, and every
input it reads has the content the run was signed with.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from contracts.paths import DataRoots, PathUse
from contracts.reports import Claim, ClaimRequest
from contracts.workflow import ENCODER_VERSION, Workflow, path_fields, replace_paths
from runtime.digest import digest_path
from runtime.store import is_store_uri
from worker.checkpoint.layout import local_path
from worker.data.store import DIGESTS, artifact_root, store_root
from worker.error import ConfigError, SignatureMismatch, TrainingError
from worker.remote.cache import Cache
from worker.remote.checkpoints import fetch_claimed, run_checkpoint
from worker.remote.objects import fetch_input
from worker.remote.tokens import token_stores
from worker.settings import WorkerSettings, get_settings

# Random per process: containers of one image share a hostname and often pid 1, so those two
# alone would give two processes handed the same message the same nonce, and one claim.
BOOT_ID = secrets.token_hex(16)


def claim_request(delivery: str | None, member: int = 0) -> ClaimRequest:
    """This process's claim for message `delivery`. Its nonce is the same for every retry of
    that message in this process (the client's retries, and Celery's after a claim whose
    answers were all lost), so a retry whose first try won gets the same claim back; another
    process handed the same message (a redelivery) sends another nonce and is refused, so two
    processes never hold one claim, even in two containers with one hostname and pid
    (`BOOT_ID`). Without `delivery`, a random nonce (one try only). `member`: which member of
    an attempt across many workers this process claims as (its message says)."""
    hostname, pid = socket.gethostname(), os.getpid()
    if delivery is None:
        nonce = secrets.token_hex(16)
    else:
        identity = f"{delivery}|{hostname}|{pid}|{BOOT_ID}" + (f"|{member}" if member else "")
        nonce = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return ClaimRequest(hostname=hostname, pid=pid, nonce=nonce, member=member)


def parse_workflow(claim: Claim) -> Workflow:
    try:
        return Workflow.model_validate(claim.workflow)
    except ValidationError as err:
        raise ConfigError(f"the claimed workflow does not parse: {err}") from err


def verify_encoder(claim: Claim) -> None:
    """The run was signed under encoding rules this worker must share: a worker of another
    version (a rolling upgrade) would train on other token ids than the run's identity says."""
    if claim.encoder_version != ENCODER_VERSION:
        raise ConfigError(
            f"run {claim.run_id} was signed with encoder version {claim.encoder_version}, this "
            f"worker encodes with version {ENCODER_VERSION}; run it on workers of the run's "
            "version, or start a new run"
        )


def verified_workflow(
    claim: Claim, settings: WorkerSettings, progress: Callable[[], None]
) -> Workflow:
    """The claim's workflow once every input this attempt reads is verified, with each input
    named by URI replaced by its verified local copy (training reads local files)."""
    return parse_workflow(verified_claim(claim, settings, progress))


def verified_claim(claim: Claim, settings: WorkerSettings, progress: Callable[[], None]) -> Claim:
    """`claim` with its inputs verified (`verify_inputs`) and localized: what to hand a
    process that trains it (a rank parses the claim's workflow itself)."""
    workflow = parse_workflow(claim)
    verify_encoder(claim)
    fetch_claimed(claim)  # on an object store: the checkpoint it starts from, into the cache
    roots = settings.paths(artifact_root(claim))
    local = verify_inputs(claim, workflow, progress, roots=roots, settings=settings)
    return localized(claim, local)


def localized(claim: Claim, local: Mapping[str, str]) -> Claim:
    """`claim` with every input of its workflow that `local` maps (a URI) named by its local
    copy, and the data digests keyed by the new names, as the stores look them up; an initial
    checkpoint fetched as an input object too."""
    if not local:
        return claim
    workflow = replace_paths(claim.workflow, lambda value: local.get(value, value))
    data = {local.get(path, path): digest for path, digest in claim.digests.data.items()}
    digests = claim.digests.model_copy(update={"data": data})
    initial = claim.initial_checkpoint
    return claim.model_copy(
        update={
            "workflow": workflow,
            "digests": digests,
            "initial_checkpoint": None if initial is None else local.get(initial, initial),
        }
    )


def verify_inputs(
    claim: Claim,
    workflow: Workflow,
    progress: Callable[[], None] | None = None,
    *,
    roots: DataRoots | None = None,
    settings: WorkerSettings | None = None,
) -> dict[str, str]:
    """Every input this attempt reads must have the content the run's signature was computed
    over: refuse before the first step, naming the file and both digests. Inputs it does not
    read are not hashed (other phases' data; the initial checkpoint once a run checkpoint
    supplies the weights), so a resume never depends on files it no longer needs. With
    `roots`, each must first resolve inside them (contracts.paths; the service checked the
    same when the run was submitted): ConfigError naming the file and the roots, nothing read.

    An input named by URI (`s3://`) is fetched into the worker's cache (`settings`', default
    the process's: worker.remote.objects.fetch_input; unchanged objects are not fetched again)
    and its copy checked. Returns {URI: local copy} for those. An initial checkpoint that is
    another run's checkpoint in the store was downloaded by `fetch_claimed` (and checked
    against its manifest); its local copy is hashed here like a local one."""
    digests = claim.digests
    uris = any(is_store_uri(p) for p in _input_paths(claim))
    if settings is None and (uris or is_store_uri(artifact_root(claim))):
        settings = get_settings()
    root = (
        store_root(artifact_root(claim))
        if settings is None
        else token_stores(artifact_root(claim), settings)[0]
    )
    phase = workflow.phases[claim.phase_index]
    reads = [s.path for s in phase.data] + [e.data for e in workflow.evals]
    checks: list[tuple[str, str, str | None]] = [
        ("tokenizer", workflow.tokenizer, digests.tokenizer)
    ]
    checks += [("data file", path, digests.data.get(path)) for path in dict.fromkeys(reads)]
    if workflow.model.pretrained is not None:
        checks.append(("pretrained model", workflow.model.pretrained, digests.pretrained))
    if claim.initial_checkpoint is not None and claim.resume_from is None:
        checks.append(("initial checkpoint", claim.initial_checkpoint, digests.initial_checkpoint))
    if roots is not None:
        for kind, path, _ in checks:
            use: PathUse = "data" if kind in ("tokenizer", "data file") else "checkpoint"
            if why := roots.refusal(path, use):
                raise ConfigError(f"{kind}: {why} (on host {socket.gethostname()})")
    local: dict[str, str] = {}
    for kind, path, expected in checks:
        if progress is not None:
            progress()  # each file hashed is progress: a stall is judged by it
        if kind == "initial checkpoint" and run_checkpoint(path) is not None:
            # Another run's checkpoint in the store: fetch_claimed downloaded it (verified
            # against its manifest); its copy is hashed like any local checkpoint.
            path = str(local_path(path))
        elif is_store_uri(path):
            assert settings is not None  # set above whenever an input is a URI
            cache = Cache(settings.cache_dir, settings.cache_max_bytes)
            if expected is None:
                raise SignatureMismatch(
                    f"{kind} {path} has no digest in the run's signature; start a new run"
                )
            try:
                copy = fetch_input(
                    path,
                    cache=cache,
                    expected_sha256=expected,
                    progress=progress,
                    digests=root / DIGESTS,
                    keep=[Path(p) for p in local.values()],  # this attempt's other copies
                )
            except SignatureMismatch as err:
                raise SignatureMismatch(f"{kind} {err}") from err
            local[path] = str(copy)
            continue
        if not Path(path).exists():
            raise TrainingError(f"{kind} {path} not found on host {socket.gethostname()}")
        # And each MiB of it. A digest is cached with its file's stat (runtime.digest): a
        # phase start on a corpus hashed before costs a stat, not a read of the corpus.
        actual = digest_path(path, progress, cache_dir=root / DIGESTS)
        if actual != expected:
            raise SignatureMismatch(
                f"{kind} {path} has SHA-256 {actual}, but the run's signature was computed "
                f"with {expected}; the file changed since the run was created (restore it, or "
                "start a new run)"
            )
    return local


def _input_paths(claim: Claim) -> list[str]:
    paths = [value for _, value, _ in path_fields(claim.workflow)]
    return paths + ([claim.initial_checkpoint] if claim.initial_checkpoint else [])
