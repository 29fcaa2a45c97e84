"""Restoring a phase before its first step: which checkpoint, which of its parts.

Restore order: model, weights, optimizer groups derived by name from the live model, optimizer
state, then the phase's private random streams. A checkpoint inside the phase continues it
(optimizer state and RNG); the previous phase's final one supplies the weights, and its
optimizer state when the phase carries it; with none, the model starts from its initial
weights. `restore_phase` does it all and returns one small value, `Restored`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import PreTrainedModel

from contracts.reports import CheckpointRef, Claim
from contracts.workflow import Workflow
from worker.checkpoint.layout import local_path, published_path, verify_checkpoint
from worker.checkpoint.resume import LoadedCheckpoint, load_checkpoint, select_resume_checkpoint
from worker.checkpoint.shards import ShardWriter, read_shards, verifier_of
from worker.error import CheckpointError, ConfigError, TrainingError
from worker.link.reporter import Reporter
from worker.model.model import build_model, load_weights
from worker.model.optim import Optimizers, build_optimizers
from worker.model.rng import PrivateRandom
from worker.train.ranks import Ranks, shard_like

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Restored:
    """A phase ready for its first step: what it trains and where it starts."""

    model: PreTrainedModel
    trained: nn.Module  # what forward and backward run through (`Ranks.wrap`)
    optimizers: Optimizers
    rng: PrivateRandom  # this rank's private random streams
    shards: ShardWriter | None  # this rank's part of sharded checkpoints; None: not sharded
    start: int  # the last global step done: the loop makes start+1 .. the phase's last
    tokens_seen: int
    # Target tokens trained per source so far in this phase (worker.train.ledger); None when
    # the checkpoint continued was written before they were counted.
    target_tokens: dict[str, int] | None
    # The checkpoint loaded (None: none, the initial weights), as the phase's outcome names it.
    resumed_from: CheckpointRef | None
    # Whether it is one of this phase (optimizer state and RNG continue from it), and whether
    # optimizer state came from it at all (inside, or carried over from the previous phase).
    inside: bool
    optimizer_loaded: bool


def phase_seed(seed: int, phase_index: int) -> int:
    """The seed of a phase's private torch generator (dropout); distinct per phase, fixed by
    the workflow."""
    return int(np.random.SeedSequence([seed % 2**64, phase_index]).generate_state(1)[0])


def restore_phase(
    claim: Claim,
    workflow: Workflow,
    tokenizer: Tokenizer,
    reporter: Reporter,
    device: torch.device,
    ranks: Ranks,
    restore_rng: bool,
) -> Restored:
    """Build the phase's model, optimizers and random streams on `device` and load what the
    checkpoint this attempt starts from holds for them (`_resume_point`). Sharded, the model is
    built in host memory and each block moved to the device as it is sharded: no device holds
    the whole model. `restore_rng=False` (tests only) leaves the random streams unrestored."""
    phase_index = claim.phase_index
    phase = workflow.phases[phase_index]
    offsets = workflow.phase_offsets()
    model = build_model(workflow, _CPU if ranks.sharded else device)
    _check_vocabulary(model, tokenizer, workflow.tokenizer)
    rng = PrivateRandom(ranks.seed(phase_seed(workflow.seed, phase_index)), device)
    # Every rank's part of a sharded checkpoint (a collective: its process group).
    shards = ShardWriter(rank=ranks.rank, device=device) if ranks.sharded else None
    resumed = _resume_point(claim, offsets, ranks, reporter)
    if resumed is not None and resumed.whole_weights:
        load_weights(model, resumed.path)
    elif resumed is None and claim.initial_checkpoint is not None:
        load_weights(model, local_path(claim.initial_checkpoint))
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
    resumed_from = None
    if resumed is not None:
        resumed_from = CheckpointRef(
            path=published_path(claim.artifact_dir, resumed.path),
            step=resumed.state.step,
            phase_index=resumed.state.phase_index,
            phase_step=resumed.state.phase_step,
        )
        log.info("attempt %s resumes from %s", claim.attempt_id, resumed.path)
    return Restored(
        model=model,
        trained=trained,
        optimizers=optimizers,
        rng=rng,
        shards=shards,
        start=inside.state.step if inside is not None else offsets[phase_index],
        tokens_seen=resumed.state.tokens_seen if resumed is not None else 0,
        target_tokens=inside.state.source_target_tokens if inside is not None else {},
        resumed_from=resumed_from,
        inside=inside is not None,
        optimizer_loaded=inside is not None or carried is not None,
    )


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


def _shard_state(optimizers: Optimizers, ranks: Ranks) -> None:
    """Sharded, optimizer state loaded whole from a checkpoint, shaped as its parameters."""
    if not ranks.sharded:
        return
    for optimizer in (optimizers.muon, optimizers.adamw):
        for param, state in optimizer.state.items():
            for key, value in state.items():
                state[key] = shard_like(value, param)


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
