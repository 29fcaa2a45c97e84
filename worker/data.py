"""Tokenization and batching.

The batch of a step is a pure function of (seed, phase_index, step, microbatch) over the
tokenized data: no loader state exists, so resuming at step s needs nothing but s.

Pretraining text becomes one flat array of EOS-joined documents, sampled as windows of
`sequence_length + 1` tokens. Supervised records become source + target + EOS, with loss on the
target and the EOS only, one record per row padded to `sequence_length`. A supervised phase may
replay pretraining text: a `{"text"}` (or plain text) source among its data is sampled as
windows, like pretraining, with its mixture weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.workflow import Phase
from worker.error import DataError
from worker.model import special_token_ids

IGNORE_INDEX = -100  # label of a position that is not a target (torch's cross_entropy default)
_JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [rows, length] int64
    labels: torch.Tensor  # [rows, length] int64; IGNORE_INDEX where nothing is predicted
    # Counted on the host when the batch is built, so the loss never waits on the device.
    target_tokens: int

    def to(self, device: torch.device) -> Batch:
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            target_tokens=self.target_tokens,
        )


@dataclass(frozen=True)
class EncodedRecord:
    ids: np.ndarray  # source tokens + target tokens + EOS, int32
    source_len: int

    @property
    def target_len(self) -> int:
        """Target tokens including the closing EOS."""
        return len(self.ids) - self.source_len


@dataclass(frozen=True)
class TextSource:
    path: str
    tokens: np.ndarray  # every document, EOS-joined, int32


@dataclass(frozen=True)
class RecordSource:
    path: str
    records: list[EncodedRecord]


@dataclass(frozen=True)
class PhaseData:
    sequence_length: int
    microbatch_size: int
    pad_id: int
    sources: list[TextSource | RecordSource]
    probabilities: np.ndarray  # per source: its share of the phase's tokens


# --- reading --------------------------------------------------------------------------------


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of every non-blank line."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, line.rstrip("\n")
    except FileNotFoundError as err:
        raise DataError(f"{path}: file not found") from err
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:  # unreadable, a directory: retrying will not help
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from err


def _json_fields(path: str, number: int, line: str, fields: Sequence[str]) -> list[str]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})"
        ) from err
    expected = "{" + ", ".join(f'"{f}"' for f in fields) + "}"
    if not isinstance(value, dict):
        raise DataError(f"{path}:{number}: expected a JSON object {expected}")
    out = []
    for field in fields:
        if field not in value:
            raise DataError(f"{path}:{number}: missing field {field!r} (records are {expected})")
        if not isinstance(value[field], str):
            raise DataError(
                f"{path}:{number}: field {field!r} must be a string, "
                f"not {type(value[field]).__name__}"
            )
        out.append(value[field])
    return out


def read_texts(path: str) -> list[str]:
    """Pretraining documents: `{"text"}` JSONL (.jsonl/.json) or plain text, one per line."""
    if path.endswith(_JSON_SUFFIXES):
        return [_json_fields(path, n, line, ["text"])[0] for n, line in _lines(path)]
    return [line for _, line in _lines(path)]


def is_text_file(path: str) -> bool:
    """Whether a file holds text (plain, or `{"text"}` JSONL) rather than supervised records;
    told by its first record."""
    if not path.endswith(_JSON_SUFFIXES):
        return True
    for number, line in _lines(path):
        try:
            first = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        return isinstance(first, dict) and "text" in first and "source" not in first
    return False


def read_pairs(path: str) -> list[tuple[int, str, str]]:
    """Supervised records `{"source", "target"}`: (line number, source, target)."""
    pairs = []
    for number, line in _lines(path):
        source, target = _json_fields(path, number, line, ["source", "target"])
        pairs.append((number, source, target))
    return pairs


# --- encoding -------------------------------------------------------------------------------


def encode_records(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]]) -> list[EncodedRecord]:
    """The one encoder of supervised records, for training and evaluation alike:
    source tokens + target tokens + EOS, no other special tokens."""
    eos_id, _ = special_token_ids(tokenizer)
    sources = tokenizer.encode_batch([s for s, _ in pairs], add_special_tokens=False)
    targets = tokenizer.encode_batch([t for _, t in pairs], add_special_tokens=False)
    records = []
    for source, target in zip(sources, targets, strict=True):
        ids = np.array([*source.ids, *target.ids, eos_id], dtype=np.int32)
        records.append(EncodedRecord(ids=ids, source_len=len(source.ids)))
    return records


def encode_record(tokenizer: Tokenizer, source: str, target: str) -> EncodedRecord:
    return encode_records(tokenizer, [(source, target)])[0]


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Documents tokenized and joined into one flat array, each followed by EOS."""
    eos_id, _ = special_token_ids(tokenizer)
    parts = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        parts.append(np.array([*encoding.ids, eos_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def record_row(record: EncodedRecord, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of one record padded to `length` (>= len(ids) - 1): position t
    predicts ids[t + 1], a target only when ids[t + 1] belongs to the target or is the EOS."""
    n = len(record.ids) - 1
    inputs = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    inputs[:n] = record.ids[:-1]
    labels[:n] = record.ids[1:]
    labels[: max(record.source_len - 1, 0)] = IGNORE_INDEX
    return inputs, labels


def window_row(window: np.ndarray, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of a run of text tokens: every token after the first is a target."""
    n = len(window) - 1
    inputs = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    inputs[:n] = window[:-1]
    labels[:n] = window[1:]
    return inputs, labels


def stack_rows(rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> Batch:
    inputs = np.stack([r[0] for r in rows])
    labels = np.stack([r[1] for r in rows])
    return Batch(
        input_ids=torch.from_numpy(inputs),
        labels=torch.from_numpy(labels),
        target_tokens=int((labels != IGNORE_INDEX).sum()),
    )


# --- a phase's training data ----------------------------------------------------------------


def load_phase_data(phase: Phase, tokenizer: Tokenizer) -> PhaseData:
    """Read and encode every source of `phase`. A supervised record that does not fit
    `sequence_length` is refused here, before the first step, never truncated."""
    _, pad_id = special_token_ids(tokenizer)
    seq = phase.sequence_length
    sources: list[TextSource | RecordSource] = []
    for spec in phase.data:
        if phase.objective == "continued_pretrain" or is_text_file(spec.path):
            tokens = encode_texts(tokenizer, read_texts(spec.path))
            if len(tokens) < seq + 1:
                raise DataError(
                    f"{spec.path}: {len(tokens)} tokens in all, fewer than one window of "
                    f"sequence_length + 1 = {seq + 1} (phase {phase.name!r})"
                )
            sources.append(TextSource(path=spec.path, tokens=tokens))
        else:
            records = _encode_training_records(spec.path, tokenizer, phase)
            sources.append(RecordSource(path=spec.path, records=records))
    weights = np.array([s.weight for s in phase.data], dtype=np.float64)
    return PhaseData(
        sequence_length=seq,
        microbatch_size=phase.microbatch_size,
        pad_id=pad_id,
        sources=sources,
        probabilities=weights / weights.sum(),
    )


def _encode_training_records(path: str, tokenizer: Tokenizer, phase: Phase) -> list[EncodedRecord]:
    pairs = read_pairs(path)
    if not pairs:
        raise DataError(f"{path}: no records (phase {phase.name!r})")
    records = encode_records(tokenizer, [(s, t) for _, s, t in pairs])
    limit = phase.sequence_length + 1
    oversized = [(pair[0], r) for pair, r in zip(pairs, records, strict=True) if len(r.ids) > limit]
    if oversized:
        line, record = oversized[0]
        more = f" ({len(oversized) - 1} more records of {len(records)} do not fit either)"
        raise DataError(
            f"{path}:{line}: record encodes to {len(record.ids)} tokens (source "
            f"{record.source_len} + target and EOS {record.target_len}), more than "
            f"sequence_length + 1 = {limit} of phase {phase.name!r}; shorten the record or "
            f"raise sequence_length" + (more if len(oversized) > 1 else "")
        )
    return records


def batch_for_step(data: PhaseData, *, seed: int, phase_index: int, step: int, micro: int) -> Batch:
    """Microbatch `micro` of global step `step`: a pure function of its arguments and the
    data. A mixture picks the source of each microbatch with probability equal to its token
    share (every microbatch of a phase holds the same number of tokens)."""
    rng = np.random.default_rng([seed % 2**64, phase_index, step, micro])
    source = data.sources[int(rng.choice(len(data.sources), p=data.probabilities))]
    seq, rows = data.sequence_length, data.microbatch_size
    if isinstance(source, TextSource):
        offsets = rng.integers(0, len(source.tokens) - seq, size=rows)
        return stack_rows(
            [window_row(source.tokens[o : o + seq + 1], seq, data.pad_id) for o in offsets]
        )
    picks = rng.integers(0, len(source.records), size=rows)
    return stack_rows([record_row(source.records[i], seq, data.pad_id) for i in picks])
