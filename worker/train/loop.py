"""One phase of a run: the training loop.

Steps are global (counted over the whole run): phase i makes updates offset+1 .. offset+steps,
where offset = workflow.phase_offsets()[i]. "The model at step s" is the model after s updates;
step 0 is the untrained (or initial-checkpoint) model whose evals are the run's baseline.

Each step runs the same sections in the same order: learning rate; what eval and checkpoint
are due; forward/backward and the optimizer step; log; the due eval and checkpoint; stop.
Restoring the phase (worker.train.restore) and keeping its checkpoints (worker.train.keeper)
happen outside the loop.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.utils import logging as transformers_logging

from contracts.reports import CheckpointRef, Claim
from contracts.workflow import Phase, Workflow
from worker import failpoint, metrics
from worker.checkpoint.layout import checkpoints_dir, local_artifact_dir, remove_stale_temporaries
from worker.checkpoint.shards import ShardWriter
from worker.checkpoint.writer import CheckpointWriter
from worker.data.batch import Batch, PhaseData, batch_for_step, load_phase_data
from worker.data.store import Stores, artifact_root
from worker.data.tokenizer import load_tokenizer
from worker.error import NonFiniteLoss
from worker.link.reporter import Reporter
from worker.model.model import configure_determinism
from worker.model.optim import Optimizers
from worker.model.rng import PrivateRandom
from worker.remote.checkpoints import RemoteCheckpoints
from worker.remote.tokens import token_stores
from worker.settings import get_settings
from worker.train.evaluate import EvalData, load_eval_data, run_evals
from worker.train.keeper import (
    CheckpointKeeper,
    NoCheckpoints,
    SaveParts,
    StopOrdered,
    gather_parts,
)
from worker.train.ledger import TokenLedger
from worker.train.objective import StepLoss, backward_step
from worker.train.ranks import Order, Ranks
from worker.train.restore import Restored, restore_phase
from worker.train.schedule import lr_multiplier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PhaseOutcome:
    # stopped: the service said stop (nothing more may be written or reported);
    # preempted: stop_requested() came true and a checkpoint of `step` was taken;
    # paused: the service said pause and a checkpoint of `step` was taken.
    status: Literal["succeeded", "stopped", "preempted", "paused"]
    step: int  # the last global step done
    checkpoint: CheckpointRef | None  # the checkpoint of `step`, if one exists
    # The checkpoint this attempt actually started from: the claim's `resume_from`, or an
    # older one when that failed verification and was quarantined; None when none was loaded.
    resumed_from: CheckpointRef | None = None


def should_checkpoint(step: int, *, every: int, last: int) -> bool:
    return step == last or step % every == 0


def should_eval(step: int, *, every: int, last: int) -> bool:
    """Step 0 is the baseline; the phase's last step is always evaluated."""
    return step == 0 or step == last or step % every == 0


def _never() -> bool:
    return False


def train_phase(
    *,
    claim: Claim,
    workflow: Workflow,
    reporter: Reporter,
    device: torch.device,
    stop_requested: Callable[[], bool] = _never,
    restore_rng: bool = True,
    ranks: Ranks = Ranks(),
) -> PhaseOutcome:
    """Train phase `claim.phase_index` from where the claim says, reporting as it goes.
    `stop_requested` (a preemption notice) is polled once per step: when it turns true the
    phase checkpoints at once and returns "preempted"; a "pause" order from the service does
    the same and returns "paused". A "stop" order returns "stopped" at once, with nothing more
    written: a save in flight is never put in place. `restore_rng=False` (tests only: the
    negative control of exact resume) leaves the random streams unrestored on resume.

    On more than one rank (`ranks`, worker.train.ranks) every rank runs this loop over its share
    of each step's microbatches; rank 0 alone evaluates, checkpoints and hears the service, and
    each step ends with its order. The outcome of another rank means nothing."""
    transformers_logging.disable_progress_bar()  # the worker logs; bars are for terminals
    phase = workflow.phases[claim.phase_index]
    offset = workflow.phase_offsets()[claim.phase_index]
    last = offset + phase.steps
    directory = checkpoints_dir(local_artifact_dir(claim.artifact_dir))
    remote = RemoteCheckpoints.of(claim.artifact_dir) if ranks.main else None
    if ranks.main:
        remove_stale_temporaries(directory)
        if remote is not None:  # no save of this run is in flight: this attempt holds it
            remote.collect_leftovers()
    configure_determinism(device)
    tokenizer = load_tokenizer(workflow.tokenizer)
    data, eval_data = _load_data(claim, workflow, tokenizer, reporter)
    restored = restore_phase(claim, workflow, tokenizer, reporter, device, ranks, restore_rng)
    model, optimizers, rng = restored.model, restored.optimizers, restored.rng
    resumed_from = restored.resumed_from
    source_names = data.names()
    keeper = _keeper(claim, workflow, reporter, ranks, tokenizer, restored, directory, remote)
    evaluate = functools.partial(run_evals, model, workflow, eval_data, reporter, phase=phase)
    save_parts = functools.partial(  # a collective: every rank at the same step
        gather_parts, ranks, rng, model, optimizers, restored.shards, last=last, directory=directory
    )
    evaluates = ranks.main or ranks.sharded  # rank 0 evaluates; sharded, every rank runs it
    start = restored.start
    ledger = TokenLedger(
        data,
        seed=workflow.seed,
        phase_index=claim.phase_index,
        tokens_seen=restored.tokens_seen,
        target_tokens=restored.target_tokens,
    )
    done = start  # the last step whose update was made
    try:
        if start == 0 and workflow.evals and evaluates:
            reporter.evals(evaluate(step=0, due=list(range(len(workflow.evals)))))

        for step in range(start + 1, last + 1):  # `step`: the update this iteration makes
            phase_step = step - offset
            # --- learning rate (a pure function of the phase step)
            muon_lr, adamw_lr = _learning_rates(workflow, phase, phase_step)
            optimizers.set_lr(muon_lr=muon_lr, adamw_lr=adamw_lr)

            # --- eval and checkpoint: what is due for the model after this update
            due_evals, checkpoint_due = _due(workflow, step, last)

            # --- forward/backward over this rank's microbatches, clipping, the optimizer step
            failpoint.hit("before_step", step)
            started = time.perf_counter()
            batches = _microbatches(data, workflow, claim.phase_index, phase_step, ranks, device)
            result = _forward_backward(restored.trained, batches, rng, ranks, len(source_names))
            max_norm = workflow.optimizer.grad_clip or math.inf
            grad_norm = _whole(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            sources = sorted(result.by_source)
            loss_value, norm_value, *source_nll = torch.stack(  # CPU-GPU sync point
                [result.loss, grad_norm, *(result.by_source[i][0] for i in sources)]
            ).tolist()
            _check_finite(loss_value, norm_value, step, phase, keeper.latest)
            _step_optimizers(
                optimizers, check_coverage=step == start + 1 and restored.optimizer_loaded
            )
            done = step
            failpoint.hit("after_step", step)
            ledger.add(phase.tokens_per_step, {i: result.by_source[i][1] for i in sources})
            elapsed = time.perf_counter() - started
            metrics.observe_step(step, elapsed, phase.tokens_per_step)

            # --- log (buffered: the reporter posts in batches)
            reporter.metrics(
                step,
                {
                    "loss": loss_value,
                    "lr": adamw_lr,
                    "lr_muon": muon_lr,
                    "grad_norm": norm_value,
                    "tokens_per_s": phase.tokens_per_step / elapsed,
                    **_source_metrics(data, source_names, phase_step, sources, source_nll, result),
                    **ledger.metrics(phase_step),
                },
            )
            # --- eval and checkpoint, as decided above (the loop waits for the snapshot only)
            if due_evals and evaluates:
                reporter.evals(evaluate(step=step, due=due_evals))
            parts = save_parts(step=step) if checkpoint_due else None  # before any stop
            # --- stop: the service's orders, then a preemption notice; rank 0's for every rank
            order = ranks.agree(
                _end_step(keeper, reporter, parts, step, last, ledger, stop_requested)
            )
            if order == "stop":
                raise StopOrdered
            if step == last:
                break
            if order != "go":
                keeper.save(step, ledger=ledger, parts=save_parts(step=step))
                keeper.wait(step)  # the save above, unless it was under way already
                return PhaseOutcome(
                    status="preempted" if order == "preempt" else "paused",
                    step=step,
                    checkpoint=keeper.latest,
                    resumed_from=resumed_from,
                )

        keeper.wait(last)
        return PhaseOutcome(
            status="succeeded", step=last, checkpoint=keeper.latest, resumed_from=resumed_from
        )
    except StopOrdered:
        log.info("the service says stop at step %d; stopping without writing", done)
        return PhaseOutcome(status="stopped", step=done, checkpoint=None, resumed_from=resumed_from)
    finally:
        _close(keeper, restored.shards)


def _load_data(
    claim: Claim, workflow: Workflow, tokenizer: Tokenizer, reporter: Reporter
) -> tuple[PhaseData, list[EvalData]]:
    """The phase's training data and every eval set's. Preparation reports nothing for minutes
    (reading and encoding data, verifying a checkpoint): the lease keeper holds the lease
    meanwhile, and each file read, batch of records encoded, MiB hashed or stage done is
    progress."""
    phase = workflow.phases[claim.phase_index]
    # Token stores are shared by every attempt, phase and run on the artifact store: a phase
    # whose files were tokenized before (by any run, or `trainctl data prepare`) maps them.
    # On an object store: in this worker's cache, downloaded when another worker published
    # them, published when built here (worker.remote.tokens).
    root, published = token_stores(artifact_root(claim), get_settings())
    stores = Stores(
        root,
        tokenizer,
        published=published,
        digests=claim.digests.data,  # verified against the files before this phase started
        progress=reporter.progress,
        fraction=reporter.preparing,
    )
    data = load_phase_data(phase, tokenizer, reporter.progress, stores=stores)
    # Eval files are read once per phase, at one geometry per task for the whole run, and
    # before the first step: a bad eval file fails the phase now, not after hours of training.
    eval_data = [
        load_eval_data(
            tokenizer, spec, sequence_length=workflow.eval_sequence_length(spec), stores=stores
        )
        for spec in workflow.evals
    ]
    reporter.progress()
    return data, eval_data


def _keeper(
    claim: Claim,
    workflow: Workflow,
    reporter: Reporter,
    ranks: Ranks,
    tokenizer: Tokenizer,
    restored: Restored,
    directory: Path,
    remote: RemoteCheckpoints | None,
) -> CheckpointKeeper | NoCheckpoints:
    """Rank 0's checkpoints (it holds the replicated state and hears the service); none on the
    other ranks. A phase resumed from a checkpoint of its own continues its checkpoints."""
    if not ranks.main:
        return NoCheckpoints()
    return CheckpointKeeper(
        writer=CheckpointWriter(
            directory=directory,
            tokenizer=tokenizer,
            upload=None if remote is None else remote.upload_files,
        ),
        reporter=reporter,
        model=restored.model,
        optimizers=restored.optimizers,
        claim=claim,
        workflow=workflow,
        latest=restored.resumed_from if restored.inside else None,
        remote=remote,
    )


def _learning_rates(workflow: Workflow, phase: Phase, phase_step: int) -> tuple[float, float]:
    """(Muon's, AdamW's) learning rate at `phase_step`: a pure function of it."""
    multiplier = phase.lr_scale * lr_multiplier(
        phase_step, total_steps=phase.steps, schedule=phase.schedule
    )
    return workflow.optimizer.muon_lr * multiplier, workflow.optimizer.adamw_lr * multiplier


def _due(workflow: Workflow, step: int, last: int) -> tuple[list[int], bool]:
    """(the eval sets, indices into `workflow.evals`, due on the model after update `step`;
    whether its checkpoint is)."""
    evals = [
        i
        for i, spec in enumerate(workflow.evals)
        if should_eval(step, every=spec.every_steps, last=last)
    ]
    return evals, should_checkpoint(step, every=workflow.checkpoint.every_steps, last=last)


def _microbatches(
    data: PhaseData,
    workflow: Workflow,
    phase_index: int,
    phase_step: int,
    ranks: Ranks,
    device: torch.device,
) -> list[Batch]:
    """This rank's share of the step's microbatches, on `device` (a pure function of the
    step: no loader state)."""
    phase = workflow.phases[phase_index]
    return [
        batch_for_step(
            data, seed=workflow.seed, phase_index=phase_index, step=phase_step, micro=micro
        ).to(device)
        for micro in ranks.share(phase.grad_accum)
    ]


def _forward_backward(
    trained: nn.Module,
    microbatches: list[Batch],
    rng: PrivateRandom,
    ranks: Ranks,
    sources: int,
) -> StepLoss:
    """Forward and backward over `microbatches`, gradients accumulated, dropout drawn from the
    phase's private streams; the loss summed over every rank's microbatches."""
    # The loss is weighted over the target tokens of the whole global batch.
    [step_tokens] = ranks.sum([float(sum(b.target_tokens for b in microbatches))])
    with rng.drawing():
        result = backward_step(
            trained,
            microbatches,
            step_tokens=int(step_tokens),
            grad_scale=ranks.grad_scale,
        )
    return _summed(result, ranks, sources)


def _step_optimizers(optimizers: Optimizers, *, check_coverage: bool) -> None:
    """Muon's and AdamW's steps, then their gradients cleared. `check_coverage`: the first
    step after optimizer state was loaded, which must cover every parameter."""
    if check_coverage:
        optimizers.step_checking_coverage()  # copies every parameter, this step only
    else:
        optimizers.step()
    optimizers.zero_grad()


def _check_finite(
    loss: float, grad_norm: float, step: int, phase: Phase, latest: CheckpointRef | None
) -> None:
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLoss(_non_finite_message(loss, grad_norm, step, phase, latest))


def _close(keeper: CheckpointKeeper | NoCheckpoints, shards: ShardWriter | None) -> None:
    """After a failure or a stop: a save in flight finishes its temporary directory, which is
    never put in place or registered."""
    try:
        keeper.close()
    finally:
        if shards is not None:
            shards.close()  # this rank's shards on disk before the process may end


def _end_step(
    keeper: CheckpointKeeper | NoCheckpoints,
    reporter: Reporter,
    parts: SaveParts | None,
    step: int,
    last: int,
    ledger: TokenLedger,
    stop_requested: Callable[[], bool],
) -> Order:
    """Rank 0's order at the end of update `step`: a background save that finished is put in
    place, the save of `parts` (when due) starts, then the service's orders and a preemption
    notice are heard (not after the phase's last step). A stop met anywhere here is "stop"."""
    try:
        keeper.collect(step)  # a background save that finished
        if parts is not None:
            keeper.save(step, ledger=ledger, parts=parts)
        if step < last:
            return _order(reporter.check(step), keeper.pause_ordered, stop_requested())
    except StopOrdered:
        return "stop"
    return "go"


def _order(action: str, pause_ordered: bool, preempted: bool) -> Order:
    """How the step ends: the service's stop first, then a preemption notice, then a pause
    (ordered now, or answered to a checkpoint's fencing check)."""
    if action == "stop":
        return "stop"
    if preempted:
        return "preempt"
    return "pause" if action == "pause" or pause_ordered else "go"


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _summed(result: StepLoss, ranks: Ranks, sources: int) -> StepLoss:
    """The step's loss and per-source sums over every rank's microbatches (alone: as is)."""
    if ranks.world == 1:
        return result
    values = [float(result.loss)]
    for i in range(sources):
        nll, tokens = result.by_source.get(i, (torch.zeros(()), 0))
        values += [float(nll), float(tokens)]
    summed = ranks.sum(values)
    by_source = {
        i: (torch.tensor(summed[1 + 2 * i]), int(summed[2 + 2 * i]))
        for i in range(sources)
        if summed[2 + 2 * i] > 0
    }
    return StepLoss(loss=torch.tensor(summed[0]), by_source=by_source)


def _source_metrics(
    data: PhaseData,
    names: list[str],
    phase_step: int,
    sources: list[int],
    nll: list[float],
    result: StepLoss,
) -> dict[str, float]:
    """Per source of a mixture: `loss/<name>` (its NLL over its target tokens, in the steps
    that hold a microbatch of it) and `token_share/<name>` (its realised share of the phase's
    envelope tokens so far). Nothing for a phase with one source: `loss` says it all."""
    if len(names) < 2:
        return {}
    out = {
        f"loss/{names[i]}": value / result.by_source[i][1]
        for i, value in zip(sources, nll, strict=True)
    }
    shares = data.realised_shares(phase_step)
    for i, name in enumerate(names):
        out[f"token_share/{name}"] = float(shares[i])
    return out


def _non_finite_message(
    loss: float, grad_norm: float, step: int, phase: Phase, latest: CheckpointRef | None
) -> str:
    where = f"at step {step} (phase {phase.name!r})"
    fallback = f"; latest checkpoint: {latest.path}" if latest is not None else ""
    return (
        f"non-finite training loss {loss} / gradient norm {grad_norm} {where}{fallback}; "
        "lower the learning rate or inspect the data of this step"
    )
