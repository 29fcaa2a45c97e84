"""One attempt, start to end: claim, verify inputs, train the phase, finish.

This is what the Celery task calls; it is plain Python, testable without Celery or a broker.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from contracts.reports import Claim, FailureCause, Finish
from contracts.workflow import Workflow
from runtime.logs import log_context
from worker import metrics
from worker.error import ConfigError, TrainingError, origin
from worker.files import no_space, out_of_space
from worker.link.client import ServiceClient, ServiceError, ServiceUnavailable, Superseded
from worker.link.reporter import ServiceReporter, SilentReporter, drain_spools
from worker.model.model import select_device
from worker.process.claim import (
    claim_request,
    parse_workflow,
    verified_claim,
)
from worker.process.launch import (
    PREEMPT,
    REPORTING,
    STOPPED,
    Gang,
    RankFailure,
    owned_devices,
    run_ranks,
)
from worker.settings import WorkerSettings, get_settings
from worker.train.loop import PhaseOutcome, train_phase
from worker.train.ranks import Ranks

log = logging.getLogger(__name__)


def _never() -> bool:
    return False


def run_attempt(
    attempt_id: str,
    *,
    settings: WorkerSettings,
    client: ServiceClient | None = None,
    stop_requested: Callable[[], bool] = _never,
    delivery: str | None = None,
    member: int = 0,
) -> PhaseOutcome | None:
    """Claim and train attempt `attempt_id`, then report how it ended (`finish`). `delivery`
    names the message being handled (the Celery task id, the same across its retries): every
    claim this process makes for it carries the same nonce (`claim_request`). Returns the
    phase's outcome, or None when it did not train to an end: the attempt was not ours to run
    (a duplicate message), it was superseded, or it failed (reported with its cause).
    Raises `ServiceUnavailable` when the service cannot be reached to claim, or to finish
    within `settings.spool_flush_seconds` (the finish then waits in the spool). Reports that
    earlier processes on this machine spooled are sent first, so that they arrive before
    anything of this attempt (they may be this very attempt's, from a process that died).
    `member` k > 0: this worker's part of an attempt across many workers (`_train_on_ranks`)."""
    own_client = client is None
    client = client or ServiceClient.from_settings(settings)
    try:
        drain_spools(client, settings.spool_dir)
        claim = client.claim(attempt_id, claim_request(delivery, member))
        if claim is None:
            log.info(
                "attempt %s is already claimed or superseded; dropping the message", attempt_id
            )
            return None
        return _run_claimed(claim, settings=settings, client=client, stop_requested=stop_requested)
    finally:
        if own_client:
            client.close()


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
            if claim.devices > 1 or claim.nodes > 1:
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


def _train_here(
    claim: Claim,
    reporter: ServiceReporter,
    settings: WorkerSettings,
    stop_requested: Callable[[], bool],
) -> PhaseOutcome:
    # Its inputs verified, and those on an object store named by their local copies.
    local = verified_claim(claim, settings, reporter.progress)
    workflow = parse_workflow(local)
    device = select_device(settings.device)
    log.info("training %s on %s", _where(claim), device)
    return train_phase(
        claim=local,
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
    ranks (worker.process.launch) and hand them the lease; rank 0 reports and finishes the
    attempt. A rank that fails ends the attempt here, with the first failed rank's cause.

    Across machines (`claim.nodes` > 1) this is member `claim.node_rank`'s part: its ranks join
    every member's at the claim's rendezvous. Member 0 is the attempt's as above. Any other
    member keeps its own lease (its heartbeats say which member it is) until its ranks end,
    ends them when a heartbeat answers "stop", posts nothing when they end well (member 0
    finishes the attempt) and posts a failed Finish with its member index when they do not."""

    verified: Claim | None = None

    def verify() -> None:
        nonlocal verified
        # The ranks get the claim with its inputs' local copies (an input on an object store
        # is fetched here, once, for all of them).
        local = verified_claim(claim, settings, reporter.progress)
        kind, ids = owned_devices(settings)
        if claim.devices > len(ids):
            raise ConfigError(
                f"the phase asks for {claim.devices} devices and this worker owns {len(ids)} "
                f"({kind}; TRAINCTL_DEVICES): it should never have been sent here"
            )
        verified = local

    _train_and_finish(claim, reporter, verify)  # reports a refusal; nothing else to report
    if verified is None:
        return None
    log.info(
        "training %s on %d ranks (member %d of %d)",
        _where(claim),
        claim.devices,
        claim.node_rank,
        claim.nodes,
    )
    outcome, failure = launch_ranks(
        verified,
        settings=settings,
        stop_requested=stop_requested,
        handed_over=reporter.close,
        abort=lambda: claim.node_rank > 0 and reporter.lease.order == "stop",
    )
    if failure is None:
        return outcome if isinstance(outcome, PhaseOutcome) else None
    if failure is STOPPED:
        log.info("%s: the service said stop; nothing more is written", _where(claim))
        return None
    # Rank 0 may have spooled reports before it was ended: they go first, as at a start.
    drain_spools(client, settings.spool_dir)
    again = _reporter(claim, settings, client)
    try:
        error = TrainingError(failure.message)
        error.cause = failure.cause
        return _train_and_finish(claim, again, lambda: _raise(error))
    finally:
        again.close()


def launch_ranks(
    claim: Claim,
    *,
    settings: WorkerSettings,
    stop_requested: Callable[[], bool],
    handed_over: Callable[[], None],
    abort: Callable[[], bool] = _never,
) -> tuple[object, RankFailure | None]:
    """Run the claimed phase on `claim.devices` ranks and wait for them (`run_ranks`); across
    machines, this member's ranks, which join the other members' at the claim's rendezvous.
    `handed_over` is called once rank 0's reporter holds the lease. A preemption notice
    (`stop_requested`) is passed on to rank 0; `abort` ends the ranks at once."""
    workdir = Path(tempfile.mkdtemp(prefix=f"trainctl-ranks-{claim.attempt_id}-"))
    gang = None
    if claim.nodes > 1:
        assert claim.rendezvous is not None  # the Claim's own check
        gang = Gang(claim.nodes, claim.node_rank, claim.rendezvous.host, claim.rendezvous.port)
    return run_ranks(
        train_rank,
        claim.devices,
        (claim.model_dump_json(),),
        workdir=workdir,
        stop_requested=stop_requested,
        handed_over=handed_over,
        gang=gang,
        abort=abort,
    )


def train_rank(device: torch.device, workdir: Path, claim_json: str) -> object:
    """A rank's work (`rank_main`): train the claimed phase. Rank 0 reports to the service and
    returns the phase's outcome; the others return None."""
    claim = Claim.model_validate_json(claim_json)
    workflow = Workflow.model_validate(claim.workflow)
    ranks = Ranks(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        device=device,
        sharding=workflow.phase_resources(claim.phase_index).sharding,
    )
    return run_rank(
        claim,
        settings=get_settings(),
        ranks=ranks,
        device=device,
        stop_requested=(workdir / PREEMPT).exists,
        reporting=lambda: (workdir / REPORTING).touch(),
    )


def run_rank(
    claim: Claim,
    *,
    settings: WorkerSettings,
    ranks: Ranks,
    device: torch.device,
    stop_requested: Callable[[], bool],
    reporting: Callable[[], None],
) -> PhaseOutcome | None:
    """One rank of a phase on many devices (worker.process.launch.rank_main). Rank 0 takes the
    lease over from the parent with a reporter of its own and finishes the attempt; the
    others train silently and leave reporting, and any refusal, to it."""
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    train = functools.partial(
        train_phase,
        claim=claim,
        workflow=parse_workflow(claim),
        device=device,
        ranks=ranks,
        restore_rng=not settings.test_skip_rng_restore,
    )
    if not ranks.main:
        with log_context(process_wide=True, run_id=claim.run_id, attempt_id=claim.attempt_id):
            try:
                train(reporter=SilentReporter())
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
                    lambda: train(reporter=reporter, stop_requested=stop_requested),
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
        member=claim.node_rank,
    )
