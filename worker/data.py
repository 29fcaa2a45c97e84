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

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.jobs import InspectionReport
from contracts.workflow import Phase, SourceGeometry
from worker.encode import Encoded, encode_records
from worker.error import DataError
from worker.model import special_token_ids
from worker.records import Record, read_records

IGNORE_INDEX = -100  # label of a position that is not a target (torch's cross_entropy default)
# Records encoded per tokenizer call; each batch done is progress (a corpus takes minutes).
ENCODE_BATCH = 4096
_GOLDEN = (math.sqrt(5) - 1) / 2


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


def record_row(encoded: Encoded, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
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
    rows: Sequence[Sequence[Encoded]], length: int, pad_id: int, *, source: int = 0
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
    tokens: np.ndarray  # every document, EOS-joined, int32
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
    records: list[Encoded]
    # Packed rows of each epoch (lists of record indices) by (seed, phase_index, index), built
    # on first use: a cache of a pure function.
    _epochs: dict[tuple[int, int, int], list[list[list[int]]]] = field(
        default_factory=dict, repr=False
    )


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
    phase: Phase, tokenizer: Tokenizer, progress: Callable[[], None] | None = None
) -> PhaseData:
    """Read and encode every source of `phase`. A supervised record that cannot be encoded
    within its source's sequence_length, or that has no target tokens, is refused here, before
    the first step, with its file, line and lengths; nothing is truncated. `progress` is called
    after each file read and each ENCODE_BATCH records encoded."""
    from worker.inspect import summarize

    _, pad_id = special_token_ids(tokenizer)
    sources: list[TextSource | RecordSource] = []
    reports = []
    for geometry in phase.sources():
        records = read_records(geometry.path)
        if progress is not None:
            progress()
        if not records:
            raise DataError(f"{geometry.path}: no records (phase {phase.name!r})")
        seq = geometry.sequence_length
        if geometry.objective == "continued_pretrain":
            _require_kind(records, "text", geometry, phase)
            encoded = _encode(tokenizer, records, sequence_length=None, progress=progress)
            tokens = np.concatenate([e.ids for e in encoded])
            if len(tokens) < seq + 1:
                raise DataError(
                    f"{geometry.path}: {len(tokens)} tokens in all, fewer than one window of "
                    f"sequence_length + 1 = {seq + 1} (phase {phase.name!r})"
                )
            sources.append(TextSource(geometry=geometry, tokens=tokens))
        else:
            _require_kind(records, "supervised", geometry, phase)
            encoded = _encode(tokenizer, records, sequence_length=seq, progress=progress)
            _refuse_unusable(records, encoded, geometry, phase)
            sources.append(RecordSource(geometry=geometry, records=encoded))
        if phase.inspection is not None:
            report = summarize(records, encoded, objective=geometry.objective, sequence_length=seq)
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


def _encode(
    tokenizer: Tokenizer,
    records: list[Record],
    *,
    sequence_length: int | None,
    progress: Callable[[], None] | None,
) -> list[Encoded]:
    """encode_records, ENCODE_BATCH records at a time (each encoded alone, so the batches
    change nothing), calling `progress` after each batch."""
    encoded: list[Encoded] = []
    for start in range(0, len(records), ENCODE_BATCH):
        batch = records[start : start + ENCODE_BATCH]
        encoded += encode_records(tokenizer, batch, sequence_length=sequence_length)
        if progress is not None:
            progress()
    return encoded


def _require_kind(records: list[Record], want: str, geometry: SourceGeometry, phase: Phase) -> None:
    for record in records:
        if (record.kind == "text") != (want == "text"):
            if want == "text":
                raise DataError(
                    f"{record.path}:{record.line}: a {record.kind} record in source "
                    f"{geometry.name!r} of phase {phase.name!r}, whose objective is "
                    'continued_pretrain: it reads {"text"} records or plain text'
                )
            raise DataError(
                f"{record.path}:{record.line}: a text record in source {geometry.name!r} of "
                f"phase {phase.name!r} ({geometry.objective}), which reads supervised records; "
                'to replay pretraining text, give this source "objective": "continued_pretrain"'
            )


def _refuse_unusable(
    records: list[Record], encoded: list[Encoded], geometry: SourceGeometry, phase: Phase
) -> None:
    bad = [(r, e) for r, e in zip(records, encoded, strict=True) if not e.usable]
    if not bad:
        return
    record, first = bad[0]
    more = (
        f" ({len(bad) - 1} more of {len(records)} records are refused too)" if len(bad) > 1 else ""
    )
    hint = (
        "shorten the record, mark its passages elastic, or raise sequence_length"
        if not first.report.fits
        else "remove it or give it a target"
    )
    raise DataError(
        f"{record.path}:{record.line}: {record.kind} record {first.report.reason} "
        f"(source {geometry.name!r}, sequence_length {geometry.sequence_length}, phase "
        f"{phase.name!r}); {hint}{more}"
    )


# --- batches --------------------------------------------------------------------------------


def _epoch_rng(seed: int, phase_index: int, source: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**64, phase_index, source, epoch])


def _pack_epoch(source: RecordSource, rng: np.random.Generator) -> list[list[int]]:
    """Records in a seeded order, laid greedily into rows of sequence_length positions."""
    seq = source.geometry.sequence_length
    rows: list[list[int]] = []
    row: list[int] = []
    fill = 0
    for i in rng.permutation(len(source.records)).tolist():
        size = len(source.records[i].ids) - 1
        if fill + size > seq:
            rows.append(row)
            row, fill = [], 0
        row.append(i)
        fill += size
    rows.append(row)
    return rows


def _record_rows(
    source: RecordSource, first: int, count: int, *, seed: int, phase_index: int, index: int
) -> list[list[Encoded]]:
    """Packed rows first .. first + count - 1 of the source's endless row stream."""
    out = []
    epochs = source._epochs.setdefault((seed, phase_index, index), [])
    epoch, start = 0, 0  # the epoch holding row `first`, and that epoch's first row number
    for g in range(first, first + count):
        while True:
            while len(epochs) <= epoch:
                rng = _epoch_rng(seed, phase_index, index, len(epochs))
                epochs.append(_pack_epoch(source, rng))
            rows = epochs[epoch]
            if g < start + len(rows):
                break
            start += len(rows)
            epoch += 1
        out.append([source.records[i] for i in rows[g - start]])
    return out


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
