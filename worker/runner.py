"""One attempt, start to end: claim, verify inputs, train the phase, finish.

This is what the Celery task calls; it is plain Python, testable without Celery or a broker.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
from pydantic import ValidationError

from contracts.paths import DataRoots, PathUse
from contracts.reports import Claim, ClaimRequest, FailureCause, Finish
from contracts.workflow import ENCODER_VERSION, Workflow
from runtime.digest import digest_path
from runtime.logs import log_context
from worker import metrics
from worker.data.store import DIGESTS, artifact_root, store_root
from worker.distributed import launch_ranks, owned_devices
from worker.error import ConfigError, SignatureMismatch, TrainingError, origin
from worker.files import no_space, out_of_space
from worker.link.client import ServiceClient, ServiceError, ServiceUnavailable, Superseded
from worker.link.reporter import ServiceReporter, SilentReporter, drain_spools
from worker.model.model import select_device
from worker.settings import WorkerSettings
from worker.train.loop import PhaseOutcome, train_phase
from worker.train.ranks import Ranks

log = logging.getLogger(__name__)

# Random per process: containers of one image share a hostname and often pid 1, so those two
# alone would give two processes handed the same message the same nonce, and one claim.
BOOT_ID = secrets.token_hex(16)


def _never() -> bool:
    return False


def run_attempt(
    attempt_id: str,
    *,
    settings: WorkerSettings,
    client: ServiceClient | None = None,
    stop_requested: Callable[[], bool] = _never,
    delivery: str | None = None,
) -> PhaseOutcome | None:
    """Claim and train attempt `attempt_id`, then report how it ended (`finish`). `delivery`
    names the message being handled (the Celery task id, the same across its retries): every
    claim this process makes for it carries the same nonce (`claim_request`). Returns the
    phase's outcome, or None when it did not train to an end: the attempt was not ours to run
    (a duplicate message), it was superseded, or it failed (reported with its cause).
    Raises `ServiceUnavailable` when the service cannot be reached to claim, or to finish
    within `settings.spool_flush_seconds` (the finish then waits in the spool). Reports that
    earlier processes on this machine spooled are sent first, so that they arrive before
    anything of this attempt (they may be this very attempt's, from a process that died)."""
    own_client = client is None
    client = client or ServiceClient.from_settings(settings)
    try:
        drain_spools(client, settings.spool_dir)
        claim = client.claim(attempt_id, claim_request(delivery))
        if claim is None:
            log.info(
                "attempt %s is already claimed or superseded; dropping the message", attempt_id
            )
            return None
        return _run_claimed(claim, settings=settings, client=client, stop_requested=stop_requested)
    finally:
        if own_client:
            client.close()


def claim_request(delivery: str | None) -> ClaimRequest:
    """This process's claim for message `delivery`. Its nonce is the same for every retry of
    that message in this process (the client's retries, and Celery's after a claim whose
    answers were all lost), so a retry whose first try won gets the same claim back; another
    process handed the same message (a redelivery) sends another nonce and is refused, so two
    processes never hold one claim, even in two containers with one hostname and pid
    (`BOOT_ID`). Without `delivery`, a random nonce (one try only)."""
    hostname, pid = socket.gethostname(), os.getpid()
    if delivery is None:
        nonce = secrets.token_hex(16)
    else:
        identity = f"{delivery}|{hostname}|{pid}|{BOOT_ID}"
        nonce = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return ClaimRequest(hostname=hostname, pid=pid, nonce=nonce)


def _run_claimed(
    claim: Claim,
    *,
    settings: WorkerSettings,
    client: ServiceClient,
    stop_requested: Callable[[], bool],
) -> PhaseOutcome | None:
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    # The lease is renewed from here to the finish, whatever the attempt is doing (on more
    # than one device, rank 0's reporter takes it over once the ranks are up).
    reporter = _reporter(claim, settings, client)
    reporter.start()
    try:
        # One attempt per process at a time: every line the process logs meanwhile, from any
        # thread, is about this attempt.
        with log_context(process_wide=True, run_id=claim.run_id, attempt_id=claim.attempt_id):
            if claim.devices > 1:
                return _train_on_ranks(
                    claim, reporter, settings=settings, client=client, stop_requested=stop_requested
                )
            return _train_and_finish(
                claim, reporter, lambda: _train_here(claim, reporter, settings, stop_requested)
            )
    finally:
        reporter.close()


def _reporter(claim: Claim, settings: WorkerSettings, client: ServiceClient) -> ServiceReporter:
    return ServiceReporter(
        client,
        claim,
        spool_dir=settings.spool_dir,
        heartbeat_seconds=settings.heartbeat_seconds,
        flush_seconds=settings.spool_flush_seconds,
        abandon_seconds=settings.abandon_seconds,
    )


def _verified_workflow(
    claim: Claim, settings: WorkerSettings, progress: Callable[[], None]
) -> Workflow:
    workflow = _parse_workflow(claim)
    verify_encoder(claim)
    verify_inputs(claim, workflow, progress, roots=settings.paths(artifact_root(claim)))
    return workflow


def _train_here(
    claim: Claim,
    reporter: ServiceReporter,
    settings: WorkerSettings,
    stop_requested: Callable[[], bool],
) -> PhaseOutcome:
    workflow = _verified_workflow(claim, settings, reporter.progress)
    device = select_device(settings.device)
    log.info("training %s on %s", _where(claim), device)
    return train_phase(
        claim=claim,
        workflow=workflow,
        reporter=reporter,
        device=device,
        stop_requested=stop_requested,
        restore_rng=not settings.test_skip_rng_restore,
    )


def _train_on_ranks(
    claim: Claim,
    reporter: ServiceReporter,
    *,
    settings: WorkerSettings,
    client: ServiceClient,
    stop_requested: Callable[[], bool],
) -> PhaseOutcome | None:
    """The parent of a phase on `claim.devices` ranks: verify the inputs once, start the
    ranks (worker.distributed) and hand them the lease; rank 0 reports and finishes the
    attempt. A rank that fails ends the attempt here, with the first failed rank's cause."""

    verified = False

    def verify() -> None:
        nonlocal verified
        _verified_workflow(claim, settings, reporter.progress)
        kind, ids = owned_devices(settings)
        if claim.devices > len(ids):
            raise ConfigError(
                f"the phase asks for {claim.devices} devices and this worker owns {len(ids)} "
                f"({kind}; TRAINCTL_DEVICES): it should never have been sent here"
            )
        verified = True

    _train_and_finish(claim, reporter, verify)  # reports a refusal; nothing else to report
    if not verified:
        return None
    log.info("training %s on %d ranks", _where(claim), claim.devices)
    outcome, failure = launch_ranks(
        claim, settings=settings, stop_requested=stop_requested, handed_over=reporter.close
    )
    if failure is None:
        return outcome if isinstance(outcome, PhaseOutcome) else None
    # Rank 0 may have spooled reports before it was ended: they go first, as at a start.
    drain_spools(client, settings.spool_dir)
    again = _reporter(claim, settings, client)
    try:
        error = TrainingError(failure.message)
        error.cause = failure.cause
        return _train_and_finish(claim, again, lambda: _raise(error))
    finally:
        again.close()


def run_rank(
    claim: Claim,
    *,
    settings: WorkerSettings,
    ranks: Ranks,
    device: torch.device,
    stop_requested: Callable[[], bool],
    reporting: Callable[[], None],
) -> PhaseOutcome | None:
    """One rank of a phase on many devices (worker.distributed.rank_main). Rank 0 takes the
    lease over from the parent with a reporter of its own and finishes the attempt; the
    others train silently and leave reporting, and any refusal, to it."""
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    workflow = _parse_workflow(claim)
    if not ranks.main:
        with log_context(process_wide=True, run_id=claim.run_id, attempt_id=claim.attempt_id):
            try:
                train_phase(
                    claim=claim,
                    workflow=workflow,
                    reporter=SilentReporter(),
                    device=device,
                    ranks=ranks,
                    restore_rng=not settings.test_skip_rng_restore,
                )
            except TrainingError as err:
                log.info("rank %d: %s (rank 0 reports it)", ranks.rank, err)
        return None
    with ServiceClient.from_settings(settings) as client:
        reporter = _reporter(claim, settings, client)
        reporter.start()
        reporting()
        try:
            with log_context(process_wide=True, run_id=claim.run_id, attempt_id=claim.attempt_id):
                return _train_and_finish(
                    claim,
                    reporter,
                    lambda: train_phase(
                        claim=claim,
                        workflow=workflow,
                        reporter=reporter,
                        device=device,
                        stop_requested=stop_requested,
                        ranks=ranks,
                        restore_rng=not settings.test_skip_rng_restore,
                    ),
                    report_crashes=False,
                )
        finally:
            reporter.close()


def _raise(err: Exception) -> NoReturn:
    raise err


def _where(claim: Claim) -> str:
    return f"attempt {claim.attempt_id} of run {claim.run_id}, phase {claim.phase_index}"


def _train_and_finish(
    claim: Claim,
    reporter: ServiceReporter,
    work: Callable[[], PhaseOutcome | None],
    *,
    report_crashes: bool = True,
) -> PhaseOutcome | None:
    """Do `work` (verify and train), then report how it ended. Returns the outcome, or None
    when the attempt was superseded, stopped or failed (the failure is reported with its
    cause). `work` returning None reports nothing: it trained nothing yet. Without
    `report_crashes` an unexpected exception is raised, not reported: rank 0 of many leaves
    it to the parent, which knows which rank failed first (a dead peer is an error in rank
    0's next collective)."""
    where = _where(claim)
    outcome: PhaseOutcome | None = None
    try:
        outcome = work()
    except Superseded:
        log.info("%s was superseded; stopping without writing", where)
        return None
    except TrainingError as err:
        finish = _failed(claim, reporter, err.cause, f"{err} ({where})")
    except (torch.OutOfMemoryError, MemoryError) as err:
        finish = _failed(claim, reporter, "oom", f"out of memory: {err} ({where})")
    except Exception as err:
        # Any write that met a full disk (a token store's, the spool's), not only a
        # checkpoint's: another attempt would meet the same wall.
        if (full := out_of_space(err)) is not None:
            finish = _failed(claim, reporter, "disk_full", f"{no_space(full)} ({where})")
        elif not report_crashes:
            raise
        else:
            log.exception("%s failed", where)
            message = f"{type(err).__name__}: {err} at {origin(err)} ({where})"
            finish = _failed(claim, reporter, "infrastructure", message)
    else:
        if outcome is None:
            return None
        if outcome.status == "stopped":
            log.info("%s: the service said stop; nothing more is written", where)
            return outcome
        finish = Finish(fencing_token=claim.fencing_token, status=outcome.status, step=outcome.step)

    if finish.status == "failed":
        log.error("%s failed (%s): %s", where, finish.cause, finish.message)
    metrics.ATTEMPTS.labels(finish.status).inc()
    try:
        try:
            reporter.finish(finish)
        except ServiceError as err:
            if isinstance(err, ServiceUnavailable) or finish.status == "failed":
                raise
            # The service does not believe this ending (a `succeeded` whose final checkpoint
            # it never got, say): end the attempt as an infrastructure failure instead, so the
            # run recovers from its latest checkpoint now rather than after a lease.
            log.error("%s: the service refused its %s finish: %s", where, finish.status, err)
            reporter.finish(
                _failed(claim, reporter, "infrastructure", f"finish refused: {err} ({where})")
            )
            return None
    except Superseded:
        log.info("%s was superseded before it finished", where)
        return None
    return outcome


def _failed(claim: Claim, reporter: ServiceReporter, cause: FailureCause, message: str) -> Finish:
    start = claim.resume_from.step if claim.resume_from is not None else 0
    return Finish(
        fencing_token=claim.fencing_token,
        status="failed",
        step=reporter.last_step if reporter.last_step is not None else start,
        cause=cause,
        message=message,
    )


def _parse_workflow(claim: Claim) -> Workflow:
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


def verify_inputs(
    claim: Claim,
    workflow: Workflow,
    progress: Callable[[], None] | None = None,
    *,
    roots: DataRoots | None = None,
) -> None:
    """Every input this attempt reads must have the content the run's signature was computed
    over: refuse before the first step, naming the file and both digests. Inputs it does not
    read are not hashed (other phases' data; the initial checkpoint once a run checkpoint
    supplies the weights), so a resume never depends on files it no longer needs. With
    `roots`, each must first resolve inside them (contracts.paths; the service checked the
    same when the run was submitted): ConfigError naming the file and the roots, nothing read.
    """
    digests = claim.digests
    root = store_root(artifact_root(claim))
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
    for kind, path, expected in checks:
        if progress is not None:
            progress()  # each file hashed is progress: a stall is judged by it
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
