"""One phase of a run: the training loop.

Steps are global (counted over the whole run): phase i makes updates offset+1 .. offset+steps,
where offset = workflow.phase_offsets()[i]. "The model at step s" is the model after s updates;
step 0 is the untrained (or initial-checkpoint) model whose evals are the run's baseline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging

from contracts.reports import CheckpointRef, Claim, EvalResult
from contracts.workflow import Phase, Workflow
from worker import failpoint, metrics
from worker.checkpoint import (
    CheckpointState,
    CheckpointWriter,
    LoadedCheckpoint,
    apply_retention,
    checkpoints_dir,
    list_checkpoints,
    load_checkpoint,
    publish_checkpoint,
    quarantine_checkpoint,
    remove_stale_temporaries,
)
from worker.checkpoint import restore_rng as set_rng_state
from worker.data import PhaseData, batch_for_step, load_phase_data
from worker.error import CheckpointError, ConfigError, NonFiniteLoss, SignatureMismatch
from worker.evaluate import evaluate_task, load_eval_data
from worker.model import build_model, configure_determinism, load_tokenizer, load_weights
from worker.objective import StepLoss, backward_step
from worker.optim import build_optimizers
from worker.reporter import Reporter
from worker.schedule import lr_multiplier

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


def phase_seed(seed: int, phase_index: int) -> int:
    """The torch seed of a phase (dropout); distinct per phase, fixed by the workflow."""
    return int(np.random.SeedSequence([seed % 2**64, phase_index]).generate_state(1)[0])


def _never() -> bool:
    return False


class _StopOrdered(Exception):
    """The service said stop: leave the loop at once, writing nothing more."""


def train_phase(
    *,
    claim: Claim,
    workflow: Workflow,
    reporter: Reporter,
    device: torch.device,
    stop_requested: Callable[[], bool] = _never,
    restore_rng: bool = True,
) -> PhaseOutcome:
    """Train phase `claim.phase_index` from where the claim says, reporting as it goes.
    `stop_requested` (a preemption notice) is polled once per step: when it turns true the
    phase checkpoints at once and returns "preempted"; a "pause" order from the service does
    the same and returns "paused". A "stop" order returns "stopped" at once, with nothing more
    written: a save in flight is never put in place. `restore_rng=False` (tests only: the
    negative control of exact resume) leaves the random streams unrestored on resume."""
    transformers_logging.disable_progress_bar()  # the worker logs; bars are for terminals
    phase_index = claim.phase_index
    phase = workflow.phases[phase_index]
    offsets = workflow.phase_offsets()
    offset, last = offsets[phase_index], offsets[phase_index] + phase.steps
    phase_finals = [o + p.steps for o, p in zip(offsets, workflow.phases, strict=True)]
    directory = checkpoints_dir(claim.artifact_dir)
    remove_stale_temporaries(directory)

    # Preparation reports nothing for a while (reading and encoding data, loading a
    # checkpoint): the reporter keeps the lease meanwhile.
    resume_step = claim.resume_from.step if claim.resume_from is not None else offset
    with reporter.keepalive(resume_step):
        configure_determinism(device)
        tokenizer = load_tokenizer(workflow.tokenizer)
        data = load_phase_data(phase, tokenizer)
        # Eval files are read once per phase, at one geometry per task for the whole run, and
        # before the first step: a bad eval file fails the phase now, not after hours of training.
        eval_data = [
            load_eval_data(tokenizer, spec, sequence_length=workflow.eval_sequence_length(spec))
            for spec in workflow.evals
        ]
        source_names = data.names()

        # Restore order: model, weights, optimizer groups derived by name from the live model,
        # optimizer state, and the RNG last (nothing after it may draw a random number).
        model = build_model(workflow, device)
        _check_vocabulary(model, tokenizer, workflow.tokenizer)
        torch.manual_seed(phase_seed(workflow.seed, phase_index))
        resumed = _checkpoint_to_resume(claim, offsets)
        if resumed is not None:
            load_weights(model, resumed.path)
        elif claim.initial_checkpoint is not None:
            load_weights(model, claim.initial_checkpoint)
        optimizers = build_optimizers(model, workflow.optimizer)
        # A checkpoint inside this phase continues it; the previous phase's final one only supplies
        # weights (fresh optimizers, the phase's own seed).
        inside = (
            resumed if resumed is not None and resumed.state.phase_index == phase_index else None
        )
        if inside is not None:
            optimizers.load_state_dict(inside.optimizer)
            if restore_rng:
                set_rng_state(inside.rng)
            else:
                log.warning("not restoring the RNG (TRAINCTL_RESTORE_RNG=false): inexact resume")
        start = inside.state.step if inside is not None else offset
        tokens_seen = resumed.state.tokens_seen if resumed is not None else 0
        resumed_from = None
        if resumed is not None:
            resumed_from = CheckpointRef(
                path=str(resumed.path),
                step=resumed.state.step,
                phase_index=resumed.state.phase_index,
                phase_step=resumed.state.phase_step,
            )
            log.info("attempt %s resumes from %s", claim.attempt_id, resumed.path)
        latest = resumed_from if inside is not None else None

    def evaluate(step: int, due: list[int]) -> list[EvalResult]:
        with reporter.keepalive(step):  # an eval reports nothing until it ends
            return [
                evaluate_task(
                    model,
                    eval_data[i],
                    batch_size=workflow.evals[i].batch_size,
                    step=step,
                    phase=phase.name,
                )
                for i in due
            ]

    # Checkpoints are saved in the background: the loop waits only for the copy into CPU
    # buffers; a save is put in place and registered (and retention applied) from this thread
    # once on disk, and only after the service confirmed this attempt is still its owner.
    writer = CheckpointWriter(directory=directory, tokenizer=tokenizer)
    done = start  # the last step whose update was made
    pause_ordered = False

    def checkpoint(step: int) -> CheckpointRef | None:
        """Start saving `step`; returns the previous save's registration if it was pending."""
        state = CheckpointState(
            step=step,
            phase_index=phase_index,
            phase_name=phase.name,
            phase_step=step - offset,
            tokens_seen=tokens_seen,
            signature=claim.signature,
            attempt_id=claim.attempt_id,
            groups=optimizers.group_names(),
        )
        return register(writer.start(model=model, optimizers=optimizers, state=state))

    def register(saved: tuple[CheckpointState, Path] | None) -> CheckpointRef | None:
        nonlocal pause_ordered
        if saved is None:
            return None
        state, tmp = saved
        # Fencing: a worker that lost its lease (a zombie revived after the reaper gave the
        # phase to another worker) learns it here, before it renames or deletes anything in
        # the run's checkpoints. Costs one request per checkpoint. An unreachable service
        # confirms nothing, but the rename never replaces a step directory and retention waits
        # for the registration to be taken, so what is written then clobbers no one.
        action = reporter.check(done, now=True)
        if action == "stop":
            raise _StopOrdered
        pause_ordered = pause_ordered or action == "pause"
        path = publish_checkpoint(tmp)
        ref = CheckpointRef(
            path=str(path), step=state.step, phase_index=phase_index, phase_step=state.phase_step
        )
        # Registered only once complete on disk. Older checkpoints are deleted only once the
        # service holds this one: until then, what it would resume from must stay.
        if reporter.checkpoint(ref):  # a registration taken is itself fenced
            # Ranked up to this step only: unregistered leftovers of a dead attempt at later
            # steps must not push out what the service holds or what this attempt started from.
            apply_retention(
                directory,
                keep_last=workflow.checkpoint.keep_last,
                keep_steps=phase_finals,
                newest=state.step,
            )
        metrics.CHECKPOINTS.inc()
        failpoint.hit("after_checkpoint", state.step)
        log.info("checkpoint %s (phase %r, step %d)", path, phase.name, state.step)
        return ref

    try:
        if start == 0 and workflow.evals:
            reporter.evals(evaluate(0, list(range(len(workflow.evals)))))

        for step in range(start + 1, last + 1):  # `step`: the update this iteration makes
            # --- learning rate (a pure function of the phase step)
            multiplier = phase.lr_scale * lr_multiplier(
                step - offset, total_steps=phase.steps, schedule=phase.schedule
            )
            muon_lr = workflow.optimizer.muon_lr * multiplier
            adamw_lr = workflow.optimizer.adamw_lr * multiplier
            optimizers.set_lr(muon_lr=muon_lr, adamw_lr=adamw_lr)

            # --- eval and checkpoint decisions, for the model after this update
            due_evals = [
                i
                for i, spec in enumerate(workflow.evals)
                if should_eval(step, every=spec.every_steps, last=last)
            ]
            checkpoint_due = should_checkpoint(
                step, every=workflow.checkpoint.every_steps, last=last
            )

            # --- forward/backward over the step's microbatches
            failpoint.hit("before_step", step)
            started = time.perf_counter()
            microbatches = [
                batch_for_step(
                    data,
                    seed=workflow.seed,
                    phase_index=phase_index,
                    step=step - offset,
                    micro=micro,
                ).to(device)
                for micro in range(phase.grad_accum)
            ]
            result = backward_step(model, microbatches)

            # --- gradient clipping, then the optimizer steps
            max_norm = workflow.optimizer.grad_clip or math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            sources = sorted(result.by_source)
            loss_value, norm_value, *source_nll = torch.stack(  # CPU-GPU sync
                [result.loss, grad_norm, *(result.by_source[i][0] for i in sources)]
            ).tolist()
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                raise NonFiniteLoss(
                    _non_finite_message(loss_value, norm_value, step, phase, latest)
                )
            if step == start + 1 and inside is not None:
                optimizers.step_checking_coverage()  # copies every parameter, this step only
            else:
                optimizers.step()
            optimizers.zero_grad()
            done = step
            failpoint.hit("after_step", step)
            tokens_seen += phase.tokens_per_step
            elapsed = time.perf_counter() - started
            metrics.observe_step(step, elapsed, phase.tokens_per_step)

            # --- log
            reporter.metrics(
                step,
                {
                    "loss": loss_value,
                    "lr": adamw_lr,
                    "lr_muon": muon_lr,
                    "grad_norm": norm_value,
                    "tokens_per_s": phase.tokens_per_step / elapsed,
                    **_source_metrics(
                        data, source_names, step - offset, sources, source_nll, result
                    ),
                },
            )
            # --- eval and checkpoint, as decided above
            if due_evals:
                reporter.evals(evaluate(step, due_evals))
            latest = register(writer.poll()) or latest  # a background save that finished
            if checkpoint_due:
                latest = checkpoint(step) or latest

            # --- stop check: the service's orders, then a preemption notice
            if step == last:
                break
            action = reporter.check(step)
            if action == "stop":
                raise _StopOrdered
            pause_ordered = pause_ordered or action == "pause"
            preempted = stop_requested()
            if pause_ordered or preempted:
                if writer.last_started != step:
                    latest = checkpoint(step) or latest
                latest = register(writer.wait()) or latest
                return PhaseOutcome(
                    status="preempted" if preempted else "paused",
                    step=step,
                    checkpoint=latest,
                    resumed_from=resumed_from,
                )

        latest = register(writer.wait()) or latest
        return PhaseOutcome(
            status="succeeded", step=last, checkpoint=latest, resumed_from=resumed_from
        )
    except _StopOrdered:
        log.info("the service says stop at step %d; stopping without writing", done)
        return PhaseOutcome(status="stopped", step=done, checkpoint=None, resumed_from=resumed_from)
    finally:
        # After a failure or a stop: a save in flight finishes its temporary directory, which
        # is never put in place or registered.
        writer.close()


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


def _checkpoint_to_resume(claim: Claim, offsets: list[int]) -> LoadedCheckpoint | None:
    """The claim's `resume_from`, verified: this run's, and either inside this phase or the
    previous phase's final checkpoint. One that fails verification (corrupt, truncated, no
    manifest) is quarantined and the newest older usable checkpoint of the same directory is
    used instead. A later phase without one cannot start."""
    phase_index = claim.phase_index
    if claim.resume_from is None:
        if phase_index > 0:
            raise CheckpointError(
                f"phase {phase_index} starts from the final checkpoint of phase "
                f"{phase_index - 1}, but the claim of attempt {claim.attempt_id} names none"
            )
        return None
    path = Path(claim.resume_from.path)
    try:
        loaded = load_checkpoint(path)
    except CheckpointError as err:
        return _fall_back(path, claim.resume_from.step, err, claim, offsets)
    state = loaded.state
    if state.signature != claim.signature:
        raise SignatureMismatch(
            f"checkpoint {loaded.path} was written by a run with signature {state.signature}, "
            f"this run's signature is {claim.signature}"
        )
    if not _starts_phase(state, phase_index, offsets):
        offset = offsets[phase_index]
        raise CheckpointError(
            f"checkpoint {loaded.path} (phase {state.phase_index}, step {state.step}) cannot "
            f"start phase {phase_index}, which covers steps {offset + 1}..; expected a "
            f"checkpoint of this phase or the final one of phase {phase_index - 1} "
            f"(step {offset})"
        )
    return loaded


def _starts_phase(state: CheckpointState, phase_index: int, offsets: list[int]) -> bool:
    """A checkpoint inside phase `phase_index`, or the previous phase's final one."""
    offset = offsets[phase_index]
    inside = state.phase_index == phase_index and state.step > offset
    previous_final = state.phase_index == phase_index - 1 and state.step == offset
    return inside or previous_final


def _fall_back(
    path: Path, step: int, err: CheckpointError, claim: Claim, offsets: list[int]
) -> LoadedCheckpoint:
    """Quarantine the failed checkpoint `path` (of `step`) and load the newest older one in
    its directory that verifies, is this run's and can start this phase."""
    log.warning(
        "checkpoint %s failed verification, quarantined as %s: %s",
        path,
        quarantine_checkpoint(path),
        err,
    )
    for older_step, candidate in list_checkpoints(path.parent):
        if older_step >= step:
            continue
        try:
            loaded = load_checkpoint(candidate)
        except CheckpointError as older_err:
            log.warning(
                "checkpoint %s failed verification, quarantined as %s: %s",
                candidate,
                quarantine_checkpoint(candidate),
                older_err,
            )
            continue
        state = loaded.state
        if state.signature == claim.signature and _starts_phase(state, claim.phase_index, offsets):
            log.warning(
                "resuming from the older checkpoint %s (step %d) instead of %s (step %d), "
                "which failed verification",
                candidate,
                older_step,
                path,
                step,
            )
            return loaded
    usable = "one inside it" + (
        f", or the final one of phase {claim.phase_index - 1}" if claim.phase_index else ""
    )
    raise CheckpointError(
        f"checkpoint {path} (step {step}) failed verification ({err}) and was quarantined; "
        f"no older complete checkpoint of this run in {path.parent} can start phase "
        f"{claim.phase_index} ({usable}); resume the run from an earlier phase or start a new run"
    )


def _check_vocabulary(model: PreTrainedModel, tokenizer: Tokenizer, path: str) -> None:
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    embedding = model.get_input_embeddings()
    rows = embedding.num_embeddings if isinstance(embedding, torch.nn.Embedding) else size
    if size > rows:
        raise ConfigError(
            f"tokenizer {path} has {size} tokens but the model's embedding has {rows} rows; "
            f"set model.config.vocab_size to at least {size}"
        )


def _non_finite_message(
    loss: float, grad_norm: float, step: int, phase: Phase, latest: CheckpointRef | None
) -> str:
    where = f"at step {step} (phase {phase.name!r})"
    fallback = f"; latest checkpoint: {latest.path}" if latest is not None else ""
    return (
        f"non-finite training loss {loss} / gradient norm {grad_norm} {where}{fallback}; "
        "lower the learning rate or inspect the data of this step"
    )
