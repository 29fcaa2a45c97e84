"""One phase of a run: the training loop.

Steps are global (counted over the whole run): phase i makes updates offset+1 .. offset+steps,
where offset = workflow.phase_offsets()[i]. "The model at step s" is the model after s updates;
step 0 is the untrained (or initial-checkpoint) model whose evals are the run's baseline.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging

from contracts.reports import CheckpointRef, Claim, EvalResult
from contracts.workflow import Phase, Workflow
from worker import failpoint, metrics
from worker.checkpoint.layout import (
    CheckpointState,
    checkpoints_dir,
    remove_stale_temporaries,
    select_expired,
    temporary_name,
    verify_checkpoint,
)
from worker.checkpoint.resume import LoadedCheckpoint, load_checkpoint, select_resume_checkpoint
from worker.checkpoint.shards import ShardedSave, ShardWriter, read_shards, verifier_of
from worker.checkpoint.writer import CheckpointWriter, publish_checkpoint
from worker.data.batch import PhaseData, batch_for_step, load_phase_data
from worker.data.store import Stores, artifact_root, store_root
from worker.data.tokenizer import load_tokenizer
from worker.error import CheckpointError, ConfigError, NonFiniteLoss, TrainingError
from worker.link.reporter import Reporter
from worker.model.model import build_model, configure_determinism, load_weights
from worker.model.optim import Optimizers, build_optimizers
from worker.model.rng import PrivateRandom
from worker.train.evaluate import EvalData, evaluate_task, load_eval_data
from worker.train.objective import StepLoss, backward_step
from worker.train.ranks import Order, Ranks, shard_like
from worker.train.schedule import lr_multiplier

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


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
    """The seed of a phase's private torch generator (dropout); distinct per phase, fixed by
    the workflow."""
    return int(np.random.SeedSequence([seed % 2**64, phase_index]).generate_state(1)[0])


def _never() -> bool:
    return False


class _StopOrdered(Exception):
    """The service said stop: leave the loop at once, writing nothing more."""


class CheckpointKeeper:
    """The phase's checkpoints, from save to retirement. Saves run in the background, one at a
    time: `save` makes the loop wait only for the copy into CPU buffers. A finished save is put
    in place and registered from the loop's thread (`collect`, `wait`, or `save` finding the
    previous one done), and only after the service confirmed that this attempt still owns the
    run (the fencing check): a "stop" met there raises _StopOrdered, a "pause" sets
    `pause_ordered`. Older checkpoints are deleted only once the service holds the new one,
    never one the service says another run needs (pinned), and each only once the service
    recorded its deletion."""

    def __init__(
        self,
        *,
        writer: CheckpointWriter,
        reporter: Reporter,
        model: PreTrainedModel,
        optimizers: Optimizers,
        claim: Claim,
        workflow: Workflow,
        latest: CheckpointRef | None,
    ) -> None:
        offsets = workflow.phase_offsets()
        self._writer = writer
        self._reporter = reporter
        self._model = model
        self._optimizers = optimizers
        self._claim = claim
        self._phase = workflow.phases[claim.phase_index]
        self._offset = offsets[claim.phase_index]
        self._directory = checkpoints_dir(claim.artifact_dir)
        self._keep_last = workflow.checkpoint.keep_last
        # Each phase's final checkpoint is kept: the next phase starts from it.
        self._phase_finals = [o + p.steps for o, p in zip(offsets, workflow.phases, strict=True)]
        self.latest = latest  # the newest registered checkpoint of this phase
        self.pause_ordered = False  # a fencing check was answered "pause"

    def save(self, step: int, *, tokens_seen: int, parts: SaveParts) -> None:
        """Start saving the model after update `step` with `parts` (gathered from every rank:
        `_parts`), unless that save is already under way; the previous save is registered
        first if it finished meanwhile."""
        if self._writer.last_started == step:
            return
        state = CheckpointState(
            step=step,
            phase_index=self._claim.phase_index,
            phase_name=self._phase.name,
            phase_step=step - self._offset,
            tokens_seen=tokens_seen,
            signature=self._claim.signature,
            attempt_id=self._claim.attempt_id,
            groups=self._optimizers.group_names(),
        )
        saved = self._writer.start(
            model=self._model,
            optimizers=self._optimizers,
            state=state,
            rng=parts.rng,
            sharded=parts.sharded,
        )
        self._register(saved, done=step)

    def collect(self, done: int) -> None:
        """Register the save in flight if it has finished; `done`: the last update made."""
        self._register(self._writer.poll(), done=done)

    def wait(self, done: int) -> None:
        """Block until the save in flight is on disk, then register it."""
        self._register(self._writer.wait(), done=done)

    def close(self) -> None:
        self._writer.close()

    def _register(self, saved: tuple[CheckpointState, Path] | None, *, done: int) -> None:
        if saved is None:
            return
        state, tmp = saved
        # Fencing: a worker that lost its lease (a zombie revived after the reaper gave the
        # phase to another worker) learns it here, before it renames or deletes anything in
        # the run's checkpoints. Costs one request per checkpoint. An unreachable service
        # confirms nothing, but the rename never replaces a step directory and retention waits
        # for the registration to be taken, so what is written then clobbers no one.
        action = self._reporter.check(done, now=True)
        if action == "stop":
            raise _StopOrdered
        self.pause_ordered = self.pause_ordered or action == "pause"
        path = publish_checkpoint(tmp)
        self.latest = CheckpointRef(
            path=str(path),
            step=state.step,
            phase_index=state.phase_index,
            phase_step=state.phase_step,
        )
        # Registered only once complete on disk. Older checkpoints are deleted only once the
        # service holds this one: until then, what it would resume from must stay.
        pinned = self._reporter.checkpoint(self.latest)  # a registration taken is fenced too
        if pinned is not None:
            self._retire(newest=state.step, pinned=pinned)
        metrics.CHECKPOINTS.inc()
        failpoint.hit("after_checkpoint", state.step)
        log.info("checkpoint %s (phase %r, step %d)", path, self._phase.name, state.step)

    def _retire(self, *, newest: int, pinned: frozenset[int]) -> None:
        """Retention, now that the service holds `newest`. Ranked up to `newest` only:
        unregistered leftovers of a dead attempt at later steps must not push out what the
        service holds or what this attempt started from; `pinned` (the answer to this very
        registration) is kept.

        Each deletion is reported first and done only once the service recorded it, so the
        registry never lists a checkpoint that is gone, and a run created from one after
        `pinned` was answered keeps it: the service refuses that report (409
        `checkpoint_pinned`). A report that is spooled (the service is unreachable) deletes
        nothing now; the next registration's retention reports it again."""
        reason = f"retention: keep_last {self._keep_last}, step {newest} registered"
        expired = select_expired(
            self._directory,
            keep_last=self._keep_last,
            keep_steps=[*self._phase_finals, *pinned],
            newest=newest,
        )
        for step, path in expired:
            if self._reporter.checkpoint_removed(step, "deleted", reason):
                shutil.rmtree(path)
            else:
                log.info("keeping checkpoint %s: the service has not recorded its deletion", path)


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
    phase_index = claim.phase_index
    phase = workflow.phases[phase_index]
    offsets = workflow.phase_offsets()
    offset, last = offsets[phase_index], offsets[phase_index] + phase.steps
    directory = checkpoints_dir(claim.artifact_dir)
    if ranks.main:
        remove_stale_temporaries(directory)

    # Preparation reports nothing for minutes (reading and encoding data, verifying a
    # checkpoint): the lease keeper holds the lease meanwhile, and each file read, batch of
    # records encoded, MiB hashed or stage done is progress.
    configure_determinism(device)
    tokenizer = load_tokenizer(workflow.tokenizer)
    # Token stores are shared by every attempt, phase and run on the artifact store: a phase
    # whose files were tokenized before (by any run, or `trainctl data prepare`) maps them.
    stores = Stores(
        store_root(artifact_root(claim)),
        tokenizer,
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
    source_names = data.names()
    reporter.progress()

    # Restore order: model, weights, optimizer groups derived by name from the live model,
    # optimizer state, then the phase's private random streams. Sharded, the model is built
    # in host memory and each block moved to the device as it is sharded: no device holds
    # the whole model.
    model = build_model(workflow, _CPU if ranks.sharded else device)
    _check_vocabulary(model, tokenizer, workflow.tokenizer)
    rng = PrivateRandom(ranks.seed(phase_seed(workflow.seed, phase_index)), device)
    # Every rank's part of a sharded checkpoint (a collective: its process group).
    shards = ShardWriter(rank=ranks.rank, device=device) if ranks.sharded else None
    resumed = _resume_point(claim, offsets, ranks, reporter)
    if resumed is not None and resumed.whole_weights:
        load_weights(model, resumed.path)
    elif resumed is None and claim.initial_checkpoint is not None:
        load_weights(model, claim.initial_checkpoint)
    # What forward and backward run through; sharded, the model's own parameters become
    # shards, so the optimizers are built over them after.
    trained = ranks.wrap(model)
    optimizers = build_optimizers(model, workflow.optimizer)
    # A checkpoint inside this phase continues it: optimizer state and RNG. The previous
    # phase's final one supplies the weights, and its optimizer state when this phase carries
    # it; the RNG is then the phase's own seed, as at every phase start (an uninterrupted run
    # starts each phase from that checkpoint in a fresh attempt too, so both stay exact).
    inside = resumed if resumed is not None and resumed.state.phase_index == phase_index else None
    carried = resumed if inside is None and phase.optimizer_state == "carry" else None
    if resumed is not None and resumed.sharded:
        # Weights not whole in it, and optimizer state, from the shards: each rank reads the
        # parts of them its own tensors cover, whatever count of ranks wrote them.
        loaded = read_shards(
            resumed.path,
            model=model,
            optimizer=resumed.optimizer if inside is not None or carried is not None else None,
            group=shards.group if shards is not None else None,
            weights=not resumed.whole_weights,
        )
        if loaded is not None:
            resumed = replace(resumed, optimizer=loaded)
            inside = resumed if inside is not None else None
            carried = resumed if carried is not None else None
    if inside is not None:
        optimizers.load_state_dict(inside.optimizer)
        _shard_state(optimizers, ranks)
        if restore_rng:
            _restore_random(rng, ranks.own_random(inside.rng), inside.path)
        else:
            log.warning("not restoring the RNG (TRAINCTL_TEST_SKIP_RNG_RESTORE): inexact resume")
    elif carried is not None:
        optimizers.load_state_dict(carried.optimizer)
        _shard_state(optimizers, ranks)
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

    keeper: CheckpointKeeper | _NoCheckpoints = _NoCheckpoints()
    if ranks.main:
        keeper = CheckpointKeeper(
            writer=CheckpointWriter(directory=directory, tokenizer=tokenizer),
            reporter=reporter,
            model=model,
            optimizers=optimizers,
            claim=claim,
            workflow=workflow,
            latest=resumed_from if inside is not None else None,
        )
    # Rank 0 evaluates (and reports); sharded, every rank runs the forward with it.
    evaluates = ranks.main or ranks.sharded
    done = start  # the last step whose update was made
    try:
        if start == 0 and workflow.evals and evaluates:
            baseline = list(range(len(workflow.evals)))
            reporter.evals(
                run_evals(model, workflow, eval_data, reporter, step=0, due=baseline, phase=phase)
            )

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
                for micro in ranks.share(phase.grad_accum)
            ]
            # The loss is weighted over the target tokens of the whole global batch.
            [step_tokens] = ranks.sum([float(sum(b.target_tokens for b in microbatches))])
            with rng.drawing():
                result = backward_step(
                    trained,
                    microbatches,
                    step_tokens=int(step_tokens),
                    grad_scale=ranks.grad_scale,
                )
            result = _summed(result, ranks, len(source_names))

            # --- gradient clipping, then the optimizer steps
            max_norm = workflow.optimizer.grad_clip or math.inf
            grad_norm = _whole(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            sources = sorted(result.by_source)
            loss_value, norm_value, *source_nll = torch.stack(  # CPU-GPU sync
                [result.loss, grad_norm, *(result.by_source[i][0] for i in sources)]
            ).tolist()
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                raise NonFiniteLoss(
                    _non_finite_message(loss_value, norm_value, step, phase, keeper.latest)
                )
            if step == start + 1 and (inside is not None or carried is not None):
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
            if due_evals and evaluates:
                reporter.evals(
                    run_evals(
                        model, workflow, eval_data, reporter, step=step, due=due_evals, phase=phase
                    )
                )
            order: Order = "go"
            # Every rank's random streams, gathered before anything on rank 0 may stop it.
            parts = None
            if checkpoint_due:
                parts = _parts(
                    ranks, rng, model, optimizers, shards, step=step, last=last, directory=directory
                )
            try:
                keeper.collect(step)  # a background save that finished
                if parts is not None:
                    keeper.save(step, tokens_seen=tokens_seen, parts=parts)
                # --- stop check: the service's orders, then a preemption notice
                if step < last:
                    order = _order(reporter.check(step), keeper.pause_ordered, stop_requested())
            except _StopOrdered:
                order = "stop"
            order = ranks.agree(order)  # every rank takes rank 0's order
            if order == "stop":
                raise _StopOrdered
            if step == last:
                break
            if order != "go":
                parts = _parts(
                    ranks, rng, model, optimizers, shards, step=step, last=last, directory=directory
                )
                keeper.save(step, tokens_seen=tokens_seen, parts=parts)  # unless under way
                keeper.wait(step)
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
    except _StopOrdered:
        log.info("the service says stop at step %d; stopping without writing", done)
        return PhaseOutcome(status="stopped", step=done, checkpoint=None, resumed_from=resumed_from)
    finally:
        # After a failure or a stop: a save in flight finishes its temporary directory, which
        # is never put in place or registered.
        try:
            keeper.close()
        finally:
            if shards is not None:
                shards.close()  # this rank's shards on disk before the process may end


def _resume_point(
    claim: Claim, offsets: list[int], ranks: Ranks, reporter: Reporter
) -> LoadedCheckpoint | None:
    """The checkpoint this attempt starts from (select_resume_checkpoint). Rank 0 chooses and
    quarantines what fails verification, each quarantine reported as it happens, before a
    failure to find any usable checkpoint propagates: the service must never hand it out
    again. Every rank verifies its share of each candidate at once (the shard files it reads,
    worker.checkpoint.shards.verifier_of), so that none waits in a collective while another hashes a
    whole checkpoint; the others load rank 0's choice without hashing it again."""

    def share(name: str) -> bool:
        return verifier_of(name, ranks.world) == ranks.rank

    def problem(path: Path) -> str | None:
        try:
            verify_checkpoint(path, reporter.progress, share=share)
        except CheckpointError as err:
            return str(err)
        return None

    if not ranks.main:
        chosen = ranks.serve_checks(problem)
        return None if chosen is None else load_checkpoint(chosen, verify=False)

    def verify(path: Path) -> None:
        if (found := ranks.check_together(path, problem)) is not None:
            raise CheckpointError(found)

    try:
        resumed = select_resume_checkpoint(
            claim,
            offsets,
            on_quarantine=lambda q: reporter.checkpoint_removed(q.step, "quarantined", q.reason),
            verify=verify,
        )
    except TrainingError:
        ranks.end_checks(None, failed=True)  # the others end too; rank 0 reports why
        raise
    ranks.end_checks(str(resumed.path) if resumed is not None else None)
    return resumed


def _order(action: str, pause_ordered: bool, preempted: bool) -> Order:
    """How the step ends: the service's stop first, then a preemption notice, then a pause
    (ordered now, or answered to a checkpoint's fencing check)."""
    if action == "stop":
        return "stop"
    if preempted:
        return "preempt"
    return "pause" if action == "pause" or pause_ordered else "go"


class _NoCheckpoints:
    """The checkpoints of a rank other than 0: none (rank 0's hold the replicated state)."""

    latest: CheckpointRef | None = None
    pause_ordered = False

    def save(self, step: int, *, tokens_seen: int, parts: SaveParts) -> None:
        pass

    def collect(self, done: int) -> None:
        pass

    def wait(self, done: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SaveParts:
    """What a checkpoint needs from every rank: their random streams, and (sharded) each
    rank's shards, being written (worker.checkpoint.shards); None: the live model's and
    optimizers'."""

    rng: dict[str, torch.Tensor]
    sharded: ShardedSave | None = None


def _parts(
    ranks: Ranks,
    rng: PrivateRandom,
    model: PreTrainedModel,
    optimizers: Optimizers,
    shards: ShardWriter | None,
    *,
    step: int,
    last: int,
    directory: Path,
) -> SaveParts:
    """Collectives: every rank calls this at the same step, before anything on rank 0 may
    stop it. Sharded, every rank starts writing its shards of `step` (and at the phase's
    `last` step, the model is gathered whole for rank 0's `model.safetensors`)."""
    sharded = None
    if shards is not None:
        sharded = shards.start(
            step,
            temporary=directory / temporary_name(step),
            model=model,
            optimizers=optimizers,
            whole=step == last,
        )
    return SaveParts(rng=ranks.gather_random(rng.state_dict()), sharded=sharded)


def _shard_state(optimizers: Optimizers, ranks: Ranks) -> None:
    """Sharded, optimizer state loaded whole from a checkpoint, shaped as its parameters."""
    if not ranks.sharded:
        return
    for optimizer in (optimizers.muon, optimizers.adamw):
        for param, state in optimizer.state.items():
            for key, value in state.items():
                state[key] = shard_like(value, param)


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


def run_evals(
    model: PreTrainedModel,
    workflow: Workflow,
    eval_data: list[EvalData],
    reporter: Reporter,
    *,
    step: int,
    due: list[int],
    phase: Phase,
) -> list[EvalResult]:
    """The results of the eval tasks `due` (indices into `workflow.evals` and `eval_data`) on
    the model after `step`, in the order of `due`."""
    results = []
    for i in due:
        results.append(
            evaluate_task(
                model,
                eval_data[i],
                batch_size=workflow.evals[i].batch_size,
                step=step,
                phase=phase.name,
            )
        )
        reporter.progress()  # an eval reports nothing until it ends: each set done is progress
    return results


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


def _restore_random(rng: PrivateRandom, state: dict[str, torch.Tensor], path: Path) -> None:
    """Continue the phase's random streams where the checkpoint left them. A checkpoint
    without them (written by an older trainctl, or on another kind of device) still resumes,
    with those streams from the phase's seed: the run goes on, not bit-exactly."""
    missing = rng.load_state_dict(state)
    if missing:
        log.warning(
            "checkpoint %s holds no random state for %s: dropout continues from the phase's "
            "seed, so this resume is not bit-identical to an uninterrupted run",
            path,
            ", ".join(missing),
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
