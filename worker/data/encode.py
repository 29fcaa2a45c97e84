"""The one encoder: a record becomes token ids, a loss mask and a report.

Training, evaluation and dataset inspection all call `encode_records`, so what inspection says
about a file is what training does with it. docs/data.md describes the encoding for people.

- text: text + EOS, every token a target (pretraining; never refused, it is cut into windows);
- pair: source + target + EOS; the loss is on the target and the EOS;
- chat: `"<role>: <content>\\n"` for a system or user message (context), `"assistant:"` then
  `" <content>"` + EOS for an assistant's; the loss is on each assistant's content and its EOS;
- segmented: the segments' texts in order, then target + EOS; the loss is on the target and
  the EOS. When the whole is longer than `sequence_length + 1` tokens, elastic segments are
  dropped or trimmed, last first, until it fits; the others and the target never are.

A record fits when its ids number at most `sequence_length + 1` (a row of `sequence_length`
positions predicts ids[1:]). Records are encoded whole and measured, never truncated silently:
what does not fit is reported (`fits` false, with the lengths), and the caller refuses it
(training) or skips and counts it (evaluation).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from worker.data.records import Record
from worker.data.tokenizer import special_token_ids

# The encoding rules' version (contracts.workflow.ENCODER_VERSION) is part of every run's
# signature; bump it there whenever the same record would encode differently.


@dataclass(frozen=True)
class EncodeReport:
    """How a record was encoded. Lengths are of the record as encoded, before any fitting."""

    kind: str
    # Tokens per part: per segment (segmented), per message (chat), (source,) for a pair,
    # (text,) for text. The target and the EOS are counted in target_tokens only.
    part_tokens: tuple[int, ...]
    source_tokens: int  # everything that is not a target
    target_tokens: int  # tokens the loss applies to, EOS (and a first token) aside
    total_tokens: int  # all ids, EOS included
    dropped_segments: tuple[int, ...] = ()
    trimmed_segments: tuple[int, ...] = ()
    tokens_trimmed: int = 0
    fits: bool = True
    # Why the record cannot be trained on (too long even after fitting, or no target), or None.
    reason: str | None = None

    @property
    def zero_target(self) -> bool:
        return self.target_tokens == 0


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int32, after fitting
    # True where ids[t] is a target (predicted from position t - 1); ids[0] never is one.
    loss_mask: np.ndarray
    report: EncodeReport

    @property
    def usable(self) -> bool:
        return self.report.fits and not self.report.zero_target

    @property
    def target_count(self) -> int:
        """Target positions of this record's row (the EOS included)."""
        return int(self.loss_mask[1:].sum())


def _pieces(record: Record) -> list[str]:
    """The strings of a record, each encoded separately, in the order `_assemble` reads them."""
    if record.kind == "text":
        return [record.text]
    if record.kind == "pair":
        return [record.source, record.target]
    if record.kind == "chat":
        # An assistant's content is its own piece, after a space: it tokenizes as a target
        # that follows "assistant:" would (a leading-space word), and nothing else is trained.
        return [p for m in record.messages for p in _chat_pieces(m.role, m.content)]
    return [s.text for s in record.segments] + [record.target]


def _chat_pieces(role: str, content: str) -> tuple[str, str]:
    if role == "assistant":
        return f"{role}:", f" {content}" if content else ""  # empty: no target at all
    return f"{role}: {content}\n", ""


def encode_records(
    tokenizer: Tokenizer, records: Sequence[Record], *, sequence_length: int | None
) -> list[Encoded]:
    """Encode `records` (one tokenizer batch call). `sequence_length` None: never fit (text,
    or measuring only)."""
    eos_id, _ = special_token_ids(tokenizer)
    return assemble(records, tokenize(tokenizer, records), eos_id, sequence_length)


def tokenize(tokenizer: Tokenizer, records: Sequence[Record]) -> list[list[list[int]]]:
    """The ids of each piece of each record (one tokenizer batch call, native code that runs
    on every core and off the GIL): the first half of `encode_records`."""
    pieces = [_pieces(r) for r in records]
    # "<|endoftext|>" written in a record is text, not a document boundary: the only special
    # token in an encoding is the EOS added here, by id.
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        # The same ids as encode_batch without the character offsets nothing here reads:
        # ~15 % less tokenizer time (measured on short pairs, bench/data_store.py).
        flat = tokenizer.encode_batch_fast(
            [p for ps in pieces for p in ps], add_special_tokens=False
        )
    finally:
        tokenizer.encode_special_tokens = before
    out, at = [], 0
    for ps in pieces:
        out.append([e.ids for e in flat[at : at + len(ps)]])
        at += len(ps)
    return out


def assemble(
    records: Sequence[Record],
    pieces: Sequence[list[list[int]]],
    eos_id: int,
    sequence_length: int | None,
) -> list[Encoded]:
    """Records from the ids of their pieces (`tokenize`): the second half of
    `encode_records`."""
    return [
        _assemble(record, ids, eos_id, sequence_length)
        for record, ids in zip(records, pieces, strict=True)
    ]


@dataclass(frozen=True)
class EncodedBatch:
    """Records encoded back to back, as columns: what a token store keeps of them. Record i
    is ids[starts[i]:starts[i] + lengths[i]]; the report fields are one array each."""

    ids: np.ndarray  # int32
    loss_mask: np.ndarray  # bool, aligned with ids
    lengths: np.ndarray  # int64, ids per record
    fits: np.ndarray  # bool
    zero_target: np.ndarray  # bool
    source_tokens: np.ndarray  # int64, as EncodeReport
    target_tokens: np.ndarray
    total_tokens: np.ndarray
    tokens_trimmed: np.ndarray
    # Per record, the indices of its segments that fitting dropped and trimmed.
    dropped_segments: Sequence[tuple[int, ...]]
    trimmed_segments: Sequence[tuple[int, ...]]

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def of(cls, encoded: Sequence[Encoded]) -> EncodedBatch:
        """The columns of records encoded one by one."""

        def column(field: str) -> np.ndarray:
            return np.fromiter((getattr(e.report, field) for e in encoded), np.int64, len(encoded))

        return cls(
            ids=np.concatenate([np.zeros(0, np.int32), *(e.ids for e in encoded)]),
            loss_mask=np.concatenate([np.zeros(0, bool), *(e.loss_mask for e in encoded)]),
            lengths=np.fromiter((len(e.ids) for e in encoded), np.int64, len(encoded)),
            fits=np.fromiter((e.report.fits for e in encoded), bool, len(encoded)),
            zero_target=np.fromiter((e.report.zero_target for e in encoded), bool, len(encoded)),
            source_tokens=column("source_tokens"),
            target_tokens=column("target_tokens"),
            total_tokens=column("total_tokens"),
            tokens_trimmed=column("tokens_trimmed"),
            dropped_segments=[e.report.dropped_segments for e in encoded],
            trimmed_segments=[e.report.trimmed_segments for e in encoded],
        )


def assemble_batch(
    records: Sequence[Record],
    pieces: Sequence[list[list[int]]],
    eos_id: int,
    sequence_length: int | None,
) -> EncodedBatch:
    """`assemble` as columns, for a token store: the same ids, masks and reports as
    `EncodedBatch.of(assemble(...))` (a test holds them equal). Text and pairs, the bulk of
    any large corpus, are assembled a batch at a time: a record by record Python loop left
    the tokenizer waiting on small cores. Chats and segmented records go one by one."""
    if not all(r.kind in _COLUMNAR for r in records):
        return EncodedBatch.of(assemble(records, pieces, eos_id, sequence_length))
    n = len(records)
    text = np.fromiter((r.kind == "text" for r in records), bool, n)
    # A text is a pair with no source: its target is everything, EOS included.
    source = np.fromiter(
        (0 if r.kind == "text" else len(p[0]) for r, p in zip(records, pieces, strict=True)),
        np.int64,
        n,
    )
    target = np.fromiter((len(p[-1]) for p in pieces), np.int64, n)
    lengths = source + target + 1
    eos = [eos_id]
    ids = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(*p, eos) for p in pieces),
        np.int32,
        int(lengths.sum()),
    )
    # Each record's mask: its source False, its target and EOS True; then its first id False
    # (nothing predicts it).
    loss_mask = np.repeat(
        np.tile(np.array([False, True]), n), np.stack([source, target + 1], 1).ravel()
    )
    starts = np.cumsum(lengths) - lengths
    loss_mask[starts] = False
    # What the loss really applies to, EOS aside (as `_judge` counts it).
    trained = (
        np.add.reduceat((loss_mask & (ids != eos_id)).astype(np.int64), starts)
        if n
        else np.zeros(0, np.int64)
    )
    fits = np.ones(n, bool) if sequence_length is None else lengths <= sequence_length + 1
    target_tokens = np.where(text, target, trained).astype(np.int64)
    none: list[tuple[int, ...]] = [()] * n
    return EncodedBatch(
        ids=ids,
        loss_mask=loss_mask,
        lengths=lengths,
        fits=fits | text,  # a text is cut into windows, never refused
        zero_target=target_tokens == 0,
        source_tokens=source,
        target_tokens=target_tokens,
        total_tokens=lengths,
        tokens_trimmed=np.zeros(n, np.int64),
        dropped_segments=none,
        trimmed_segments=none,
    )


_COLUMNAR = frozenset({"text", "pair"})


def encode_record(tokenizer: Tokenizer, record: Record, *, sequence_length: int | None) -> Encoded:
    return encode_records(tokenizer, [record], sequence_length=sequence_length)[0]


def _assemble(
    record: Record,
    ids: list[list[int]],
    eos_id: int,
    sequence_length: int | None,
) -> Encoded:
    if record.kind == "text":
        tokens = [*ids[0], eos_id]
        report = EncodeReport(
            kind="text",
            part_tokens=(len(ids[0]),),
            source_tokens=0,
            target_tokens=len(ids[0]),
            total_tokens=len(tokens),
        )
        mask = np.ones(len(tokens), bool)
        mask[0] = False  # nothing predicts the first token
        return Encoded(np.array(tokens, np.int32), mask, report)
    if record.kind == "pair":
        return _finish(
            "pair",
            parts=[(ids[0], False)],
            target=ids[1],
            eos_id=eos_id,
            sequence_length=sequence_length,
        )
    if record.kind == "chat":
        parts: list[tuple[list[int], bool]] = []
        part_tokens = []
        for i, message in enumerate(record.messages):
            head, content = ids[2 * i], ids[2 * i + 1]
            if message.role == "assistant":
                parts += [(head, False), ([*content, eos_id], True)]
                part_tokens.append(len(head) + len(content) + 1)
            else:
                parts.append((head, False))  # the whole "role: content\n"
                part_tokens.append(len(head))
        return _finish_chat(parts, tuple(part_tokens), sequence_length, eos_id)
    return _fit_segments(record, ids, eos_id, sequence_length)


def _finish(
    kind: str,
    *,
    parts: list[tuple[list[int], bool]],
    target: list[int],
    eos_id: int,
    sequence_length: int | None,
    dropped: tuple[int, ...] = (),
    trimmed: tuple[int, ...] = (),
    tokens_trimmed: int = 0,
    part_tokens: tuple[int, ...] | None = None,
    total_before: int | None = None,
) -> Encoded:
    """Prompt parts (ids, is_target) + target + EOS, measured against `sequence_length`."""
    tokens: list[int] = []
    spans: list[tuple[int, int]] = []  # where the targets are
    for part, is_target in parts:
        if is_target:
            spans.append((len(tokens), len(tokens) + len(part)))
        tokens.extend(part)
    source = len(tokens)
    tokens.extend(target)
    tokens.append(eos_id)
    spans.append((source, len(tokens)))
    return _judge(
        tokens,
        spans,
        sequence_length,
        eos_id,
        kind=kind,
        part_tokens=part_tokens if part_tokens is not None else tuple(len(p) for p, _ in parts),
        source_tokens=source + tokens_trimmed,
        total_tokens=total_before if total_before is not None else len(tokens),
        dropped_segments=dropped,
        trimmed_segments=trimmed,
        tokens_trimmed=tokens_trimmed,
    )


def _finish_chat(
    parts: list[tuple[list[int], bool]],
    part_tokens: tuple[int, ...],
    sequence_length: int | None,
    eos_id: int,
) -> Encoded:
    tokens: list[int] = []
    spans: list[tuple[int, int]] = []
    for part, is_target in parts:
        if is_target:
            spans.append((len(tokens), len(tokens) + len(part)))
        tokens.extend(part)
    targets = sum(end - start for start, end in spans)
    return _judge(
        tokens,
        spans,
        sequence_length,
        eos_id,
        kind="chat",
        part_tokens=part_tokens,
        source_tokens=len(tokens) - targets,
        total_tokens=len(tokens),
    )


def _judge(
    tokens: list[int],
    spans: list[tuple[int, int]],
    sequence_length: int | None,
    eos_id: int,
    **report: Any,
) -> Encoded:
    """The record's ids, its loss mask (True over the target `spans`) and its report, whose
    remaining fields are `report`. Built from spans, not a per-token list: this runs once per
    record of every corpus a store is built from."""
    ids = np.array(tokens, np.int32)
    loss_mask = np.zeros(len(tokens), bool)
    for start, end in spans:
        loss_mask[start:end] = True
    if len(loss_mask):
        loss_mask[0] = False  # nothing predicts the first token
    # What the loss really applies to, EOS aside: a target whose only token opens the record
    # (an empty source) trains nothing but the EOS, as an empty target does.
    trained = int(np.count_nonzero(loss_mask & (ids != eos_id)))
    reason = None
    limit = None if sequence_length is None else sequence_length + 1
    fits = limit is None or len(tokens) <= limit
    if trained == 0:
        reason = ZERO_TARGET
    elif not fits:
        assert limit is not None
        reason = too_long(len(tokens), int(np.count_nonzero(loss_mask)), limit)
    return Encoded(
        ids, loss_mask, EncodeReport(**report, target_tokens=trained, fits=fits, reason=reason)
    )


ZERO_TARGET = "no target tokens (an empty target trains nothing but the EOS)"


def too_long(tokens: int, targets: int, limit: int) -> str:
    """Why a record of `tokens` ids, `targets` of them trained on, does not fit `limit`."""
    return (
        f"encodes to {tokens} tokens (prompt {tokens - targets} + target and EOS {targets}), "
        f"more than sequence_length + 1 = {limit}"
    )


def _fit_segments(
    record: Record, ids: list[list[int]], eos_id: int, sequence_length: int | None
) -> Encoded:
    """Drop or trim elastic segments, last first, until the record fits."""
    segments = [list(s) for s in ids[:-1]]
    target = ids[-1]
    part_tokens = tuple(len(s) for s in segments)
    total = sum(part_tokens) + len(target) + 1
    dropped: list[int] = []
    trimmed: list[int] = []
    cut = 0
    if sequence_length is not None:
        overflow = total - (sequence_length + 1)
        for i in reversed(range(len(segments))):
            if overflow <= 0:
                break
            elastic, n = record.segments[i].elastic, len(segments[i])
            if elastic is None or n == 0:
                continue
            if elastic == "drop" or n <= overflow:
                segments[i] = []
                dropped.append(i)
                overflow -= n
                cut += n
            else:
                segments[i] = (
                    segments[i][overflow:] if elastic == "start" else segments[i][:-overflow]
                )
                trimmed.append(i)
                cut += overflow
                overflow = 0
    return _finish(
        "segmented",
        parts=[(s, False) for s in segments],
        target=target,
        eos_id=eos_id,
        sequence_length=sequence_length,
        dropped=tuple(sorted(dropped)),
        trimmed=tuple(trimmed),
        tokens_trimmed=cut,
        part_tokens=part_tokens,
        total_before=total,
    )
