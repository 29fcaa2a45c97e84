"""A phase's training data: sources, mixture and batches.

The batch of a step is a pure function of (seed, phase_index, step, microbatch) over the encoded
data: no loader state exists, so resuming at step s needs nothing but s.

Every microbatch fills the workflow's token envelope exactly: `sequence_length x
microbatch_size` of the source it comes from (a replay source has its own geometry).

- Pretraining text (objective `continued_pretrain`) is one flat array of EOS-joined documents
  cut into windows of `sequence_length + 1` tokens; a seeded permutation per epoch orders the
  windows. Documents within a window attend to each other, as in pretraining.
- Supervised records are packed: each record is a block of len(ids) - 1 positions, blocks are
  laid into rows greedily in a seeded order per epoch, and the rest of a row is padding. A 4-D
  block-diagonal causal mask keeps a record from attending to any other, and position ids
  restart at every record, so a packed record computes what it would alone.
- Sources are interleaved by microbatch in proportion to their weights (shares of envelope
  tokens) by a fixed low-discrepancy sequence, so the realised share follows the plan closely.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.jobs import InspectionReport
from contracts.workflow import Phase, SourceGeometry
from worker.data.inspect import summarize_store
from worker.data.store import KINDS, Stores, TokenFile
from worker.data.tokenizer import special_token_ids
from worker.error import DataError

IGNORE_INDEX = -100  # label of a position that is not a target (torch's cross_entropy default)
_GOLDEN = (math.sqrt(5) - 1) / 2


class Tokens(Protocol):
    """A record's token ids and loss mask: an encoded record, or one read from a store."""

    @property
    def ids(self) -> np.ndarray: ...

    @property
    def loss_mask(self) -> np.ndarray: ...


@dataclass(frozen=True)
class StoredRecord:
    ids: np.ndarray
    loss_mask: np.ndarray


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [rows, length] int64
    labels: torch.Tensor  # [rows, length] int64; IGNORE_INDEX where nothing is predicted
    # Counted on the host when the batch is built, so the loss never waits on the device.
    target_tokens: int
    # Packed records: [rows, 1, length, length] bool (True: may attend) and [rows, length].
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    source: int = 0  # index of the phase source it came from

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            target_tokens=self.target_tokens,
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            source=self.source,
        )


# --- rows -----------------------------------------------------------------------------------


def record_row(encoded: Tokens, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of one record padded to `length` (>= len(ids) - 1): position t
    predicts ids[t + 1], a target where the loss mask says so."""
    n = len(encoded.ids) - 1
    inputs = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    inputs[:n] = encoded.ids[:-1]
    labels[:n] = np.where(encoded.loss_mask[1:], encoded.ids[1:], IGNORE_INDEX)
    return inputs, labels


def window_row(window: np.ndarray, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of a run of text tokens: every token after the first is a target."""
    n = len(window) - 1
    inputs = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    inputs[:n] = window[:-1]
    labels[:n] = window[1:]
    return inputs, labels


def stack_rows(rows: Sequence[tuple[np.ndarray, np.ndarray]], *, source: int = 0) -> Batch:
    inputs = np.stack([r[0] for r in rows])
    labels = np.stack([r[1] for r in rows])
    return Batch(
        input_ids=torch.from_numpy(inputs),
        labels=torch.from_numpy(labels),
        target_tokens=int((labels != IGNORE_INDEX).sum()),
        source=source,
    )


def packed_rows(
    rows: Sequence[Sequence[Tokens]], length: int, pad_id: int, *, source: int = 0
) -> Batch:
    """Rows of packed records with their block-diagonal causal mask and per-record positions.
    Each padding position is a block of its own (it attends to itself only)."""
    n = len(rows)
    inputs = np.full((n, length), pad_id, dtype=np.int64)
    labels = np.full((n, length), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((n, length), dtype=np.int64)
    blocks = np.tile(-1 - np.arange(length), (n, 1))  # padding: distinct negative ids
    for r, records in enumerate(rows):
        at = 0
        for b, encoded in enumerate(records):
            inputs_, labels_ = record_row(encoded, len(encoded.ids) - 1, pad_id)
            k = len(inputs_)
            inputs[r, at : at + k] = inputs_
            labels[r, at : at + k] = labels_
            positions[r, at : at + k] = np.arange(k)
            blocks[r, at : at + k] = b
            at += k
    block = torch.from_numpy(blocks)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (block[:, :, None] == block[:, None, :]) & causal
    return Batch(
        input_ids=torch.from_numpy(inputs),
        labels=torch.from_numpy(labels),
        target_tokens=int((labels != IGNORE_INDEX).sum()),
        attention_mask=mask[:, None],
        position_ids=torch.from_numpy(positions),
        source=source,
    )


# --- sources --------------------------------------------------------------------------------


@dataclass
class TextSource:
    geometry: SourceGeometry
    tokens: np.ndarray  # every document, EOS-joined: the store's ids, memory-mapped
    # The window order last used: ((seed, phase_index, index, epoch), permutation).
    _order: tuple[tuple[int, ...], np.ndarray] | None = field(default=None, repr=False)

    @property
    def windows(self) -> int:
        return (len(self.tokens) - 1) // self.geometry.sequence_length

    def window(self, g: int, *, seed: int, phase_index: int, index: int) -> np.ndarray:
        """Window g of the source's endless stream: epoch g // windows, in a seeded order."""
        n, seq = self.windows, self.geometry.sequence_length
        key = (seed, phase_index, index, g // n)
        if self._order is None or self._order[0] != key:
            self._order = (key, _epoch_rng(*key).permutation(n))
        k = int(self._order[1][g % n])
        return self.tokens[k * seq : k * seq + seq + 1]


@dataclass
class RecordSource:
    geometry: SourceGeometry
    store: TokenFile
    # Positions each record takes in a row (its ids but the last), read once from the store.
    sizes: np.ndarray
    # Packed epochs by (seed, phase_index, index), built on first use (a cache of a pure
    # function): the epoch's record order, and where each row starts in it.
    _epochs: dict[tuple[int, int, int], list[tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=dict, repr=False
    )

    def record(self, i: int) -> StoredRecord:
        ids, mask = self.store.record(i)
        return StoredRecord(ids, mask)


@dataclass(frozen=True)
class PhaseData:
    sources: list[TextSource | RecordSource]
    pad_id: int
    # Source of each of the phase's microbatches, in order; and per source, how many of the
    # first m microbatches came from it (row m, int32: [microbatches + 1, sources]).
    schedule: np.ndarray
    counts: np.ndarray
    grad_accum: int
    reports: list[InspectionReport] = field(default_factory=list)

    def names(self) -> list[str]:
        return [s.geometry.name for s in self.sources]

    def realised_shares(self, phase_step: int) -> np.ndarray:
        """Each source's share of the microbatches of phase steps 1 .. phase_step."""
        m = phase_step * self.grad_accum
        return self.counts[m] / m


def mixture_schedule(weights: Sequence[float], count: int) -> np.ndarray:
    """Source index of each of `count` microbatches: source i takes a share weight_i / sum of
    them, interleaved evenly (the golden-ratio sequence over the cumulative shares). Fixed by
    the weights alone, so (step, micro) determines the source."""
    shares = np.asarray(weights, dtype=np.float64)
    edges = np.cumsum(shares / shares.sum())
    u = (np.arange(count, dtype=np.float64) * _GOLDEN) % 1.0
    return np.minimum(np.searchsorted(edges, u, side="right"), len(shares) - 1).astype(np.int32)


def _cumulative_counts(schedule: np.ndarray, sources: int) -> np.ndarray:
    counts = np.zeros((len(schedule) + 1, sources), dtype=np.int32)
    counts[1:] = np.cumsum(np.eye(sources, dtype=np.int32)[schedule], axis=0)
    return counts


def load_phase_data(
    phase: Phase,
    tokenizer: Tokenizer,
    progress: Callable[[], None] | None = None,
    *,
    stores: Stores | None = None,
) -> PhaseData:
    """Open (building them first where missing) the token stores of every source of `phase`.
    A line that is not a record, and a supervised record that cannot be encoded within its
    source's sequence_length or that has no target tokens, is refused here, before the first
    step, with its file, line and lengths; nothing is truncated or skipped. `progress` is
    called as stores are opened or built. Without `stores`, each file is tokenized into a
    private store that lives as long as its memory maps (tests, one-off tools)."""
    if stores is None:
        with Stores.temporary(tokenizer, progress=progress) as temporary:
            return load_phase_data(phase, tokenizer, progress, stores=temporary)
    _, pad_id = special_token_ids(tokenizer)
    sources: list[TextSource | RecordSource] = []
    reports = []
    for geometry in phase.sources():
        text = geometry.objective == "continued_pretrain"
        seq = geometry.sequence_length
        store = stores.get(geometry.path, fit=None if text else seq)
        if progress is not None:
            progress()
        _refuse_invalid(store, geometry, phase)
        if len(store) == 0:
            raise DataError(f"{geometry.path}: no records (phase {phase.name!r})")
        _require_kind(store, text, geometry, phase)
        if text:
            if store.tokens < seq + 1:
                raise DataError(
                    f"{geometry.path}: {store.tokens} tokens in all, fewer than one window of "
                    f"sequence_length + 1 = {seq + 1} (phase {phase.name!r})"
                )
            sources.append(TextSource(geometry=geometry, tokens=store.ids))
        else:
            _refuse_unusable(store, geometry, phase)
            sources.append(RecordSource(geometry=geometry, store=store, sizes=store.lengths() - 1))
        if phase.inspection is not None:
            report = summarize_store(store, objective=geometry.objective, sequence_length=seq)
            if failures := report.gate_failures(phase.inspection):
                raise DataError(
                    f"{geometry.path}: inspection required by phase {phase.name!r} failed: "
                    + "; ".join(failures)
                )
            reports.append(report)
    count = phase.steps * phase.grad_accum
    schedule = mixture_schedule([g.weight for g in phase.sources()], count)
    return PhaseData(
        sources=sources,
        pad_id=pad_id,
        schedule=schedule,
        counts=_cumulative_counts(schedule, len(sources)),
        grad_accum=phase.grad_accum,
        reports=reports,
    )


def _refuse_invalid(store: TokenFile, geometry: SourceGeometry, phase: Phase) -> None:
    """Training takes every line of its files or none: the first line that is not a record
    fails the phase, named as the reader of the file would name it (evaluation skips it)."""
    if not store.invalid:
        return
    count = sum(store.invalid.values())
    more = f"; {count - 1} more lines of it are not records either" if count > 1 else ""
    raise DataError(
        f"{store.invalid_lines[0].message(geometry.path)} (source {geometry.name!r} of phase "
        f"{phase.name!r}{more})"
    )


def _require_kind(store: TokenFile, text: bool, geometry: SourceGeometry, phase: Phase) -> None:
    first = store.first_of_other_kind(text)
    if first is None:
        return
    kind, line = KINDS[store.kinds()[first]], int(store.records["line"][first])
    if text:
        raise DataError(
            f"{geometry.path}:{line}: a {kind} record in source {geometry.name!r} of phase "
            f'{phase.name!r}, whose objective is continued_pretrain: it reads {{"text"}} '
            "records or plain text"
        )
    raise DataError(
        f"{geometry.path}:{line}: a text record in source {geometry.name!r} of "
        f"phase {phase.name!r} ({geometry.objective}), which reads supervised records; "
        'to replay pretraining text, give this source "objective": "continued_pretrain"'
    )


def _refuse_unusable(store: TokenFile, geometry: SourceGeometry, phase: Phase) -> None:
    records = store.records
    bad = np.flatnonzero(~store.usable())
    if not bad.size:
        return
    first = int(bad[0])
    more = f" ({bad.size - 1} more of {len(store)} records are refused too)" if bad.size > 1 else ""
    fits = bool(records["fits"][first])
    hint = (
        "shorten the record, mark its passages elastic, or raise sequence_length"
        if not fits
        else "remove it or give it a target"
    )
    reason = store.unusable_reason(first, geometry.sequence_length + 1)
    raise DataError(
        f"{geometry.path}:{int(records['line'][first])}: {KINDS[records['kind'][first]]} record "
        f"{reason} (source {geometry.name!r}, sequence_length {geometry.sequence_length}, phase "
        f"{phase.name!r}); {hint}{more}"
    )


# --- batches --------------------------------------------------------------------------------


def _epoch_rng(seed: int, phase_index: int, source: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**64, phase_index, source, epoch])


def _pack_epoch(
    sizes: np.ndarray, seq: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Records in a seeded order, laid greedily into rows of `seq` positions: (order, starts),
    row r holding records order[starts[r]:starts[r + 1]]. Two int64 arrays per epoch, read
    from the stored sizes alone."""
    order = rng.permutation(len(sizes))
    starts = [0]
    fill = 0
    for k, size in enumerate(sizes[order].tolist()):
        if fill + size > seq:
            starts.append(k)
            fill = 0
        fill += size
    starts.append(len(order))
    return order, np.asarray(starts, dtype=np.int64)


def _record_rows(
    source: RecordSource, first: int, count: int, *, seed: int, phase_index: int, index: int
) -> list[list[StoredRecord]]:
    """Packed rows first .. first + count - 1 of the source's endless row stream, read from
    the store."""
    out = []
    epoch, start = 0, 0  # the epoch holding row `first`, and that epoch's first row number
    for g in range(first, first + count):
        while True:
            order, starts = _packed_epoch(
                source, epoch, seed=seed, phase_index=phase_index, index=index
            )
            rows = len(starts) - 1
            if g < start + rows:
                break
            start += rows
            epoch += 1
        r = g - start
        out.append([source.record(int(i)) for i in order[starts[r] : starts[r + 1]]])
    return out


def _packed_epoch(
    source: RecordSource, epoch: int, *, seed: int, phase_index: int, index: int
) -> tuple[np.ndarray, np.ndarray]:
    """Epoch `epoch` of the source's row stream, (order, starts) as `_pack_epoch` lays it out,
    packed on first use and kept."""
    epochs = source._epochs.setdefault((seed, phase_index, index), [])
    while len(epochs) <= epoch:
        rng = _epoch_rng(seed, phase_index, index, len(epochs))
        epochs.append(_pack_epoch(source.sizes, source.geometry.sequence_length, rng))
    return epochs[epoch]


def batch_for_step(data: PhaseData, *, seed: int, phase_index: int, step: int, micro: int) -> Batch:
    """Microbatch `micro` of phase step `step` (1-based within the phase): a pure function of
    its arguments and the data."""
    m = (step - 1) * data.grad_accum + micro
    index = int(data.schedule[m])
    source = data.sources[index]
    seq, rows = source.geometry.sequence_length, source.geometry.microbatch_size
    first = int(data.counts[m, index]) * rows  # this source's microbatches before m
    if isinstance(source, TextSource):
        windows = [
            source.window(g, seed=seed, phase_index=phase_index, index=index)
            for g in range(first, first + rows)
        ]
        return stack_rows([window_row(w, seq, data.pad_id) for w in windows], source=index)
    packed = _record_rows(source, first, rows, seed=seed, phase_index=phase_index, index=index)
    return packed_rows(packed, seq, data.pad_id, source=index)


def epochs_seen(data: PhaseData, *, seed: int, phase_index: int, phase_step: int) -> list[float]:
    """Per source, how many times phase steps 1 .. phase_step went through it: the windows (of
    text) or records (packed rows' worth) read, over those it holds. A pure function of the
    step, like the batches: exact whatever attempts the steps took."""
    m = phase_step * data.grad_accum
    out = []
    for index, source in enumerate(data.sources):
        rows = int(data.counts[m, index]) * source.geometry.microbatch_size  # rows read
        if isinstance(source, TextSource):
            out.append(rows / source.windows)
            continue
        epoch = 0
        while True:
            order, starts = _packed_epoch(
                source, epoch, seed=seed, phase_index=phase_index, index=index
            )
            if rows < len(starts) - 1:
                break
            rows -= len(starts) - 1
            epoch += 1
        out.append(epoch + int(starts[rows]) / len(order))
    return out
