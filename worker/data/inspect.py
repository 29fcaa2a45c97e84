"""Dataset inspection: what training would make of a file, before a GPU hour is spent on it.

It reads the token store that training reads (worker.data.store: the exact tokenizer and the one
encoder), so "refused", "trimmed" and the lengths here are what training does, not an
estimate, and a file of any size is inspected in memory bounded by its per-record columns.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from contracts.jobs import (
    InspectionReport,
    InspectRequest,
    LengthStats,
    RecordProblem,
    SegmentSurvival,
)
from contracts.workflow import Objective
from worker.data.encode import Encoded, EncodedBatch
from worker.data.records import ELASTIC, Record, read_lines
from worker.data.store import (
    DROPPED,
    KEPT,
    KINDS,
    TRIMMED,
    Columns,
    InvalidLine,
    Stores,
    TokenFile,
)
from worker.data.tokenizer import load_tokenizer

MAX_PROBLEMS = 50  # problems listed with their line numbers; all are counted


def inspect_file(
    request: InspectRequest,
    *,
    write_fit: str | Path | None = None,
    stores: Stores | None = None,
) -> InspectionReport:
    """Inspect `request.path` from its token store (built first where missing; without
    `stores`, a private one). With `write_fit`, also write the records that training would
    take (the original lines, decompressed) to that file, atomically. Memory is bounded by the
    store's per-record columns, not the file's text."""
    if stores is None:
        with Stores.temporary(load_tokenizer(request.tokenizer)) as temporary:
            return inspect_file(request, write_fit=write_fit, stores=temporary)
    text = request.objective == "continued_pretrain"
    store = stores.get(request.path, fit=None if text else request.sequence_length)
    report = summarize_store(
        store, objective=request.objective, sequence_length=request.sequence_length
    )
    if write_fit is not None:
        trainable = store.is_text() if text else store.usable()
        lines = np.asarray(store.records["line"][trainable])
        written = _write_lines(Path(write_fit), _lines_numbered(request.path, lines))
        report = report.model_copy(update={"fit_path": str(write_fit), "fit_written": written})
    return report


def _lines_numbered(path: str, numbers: np.ndarray) -> Iterator[str]:
    """The lines of `path` whose numbers are in `numbers` (ascending), read streaming."""
    at = 0
    for number, line in read_lines(path):
        while at < len(numbers) and numbers[at] < number:
            at += 1
        if at == len(numbers):
            return
        if numbers[at] == number:
            yield line


def summarize(
    records: Sequence[Record],
    encoded: Sequence[Encoded],
    *,
    objective: Objective,
    sequence_length: int,
) -> InspectionReport:
    """The report of records encoded in memory: the store's columns, made here."""
    columns = Columns()
    rows, segments = columns.rows(records, EncodedBatch.of(encoded), 0)
    return _summarize(
        path=records[0].path if records else "",
        rows=rows,
        segments=segments,
        roles=list(columns.roles),
        lengths=np.array([len(e.ids) for e in encoded], dtype=np.int64),
        reason=lambda i: encoded[i].report.reason or "does not fit",
        objective=objective,
        sequence_length=sequence_length,
    )


def summarize_store(
    store: TokenFile, *, objective: Objective, sequence_length: int
) -> InspectionReport:
    """The report of a file from its store (training's phase gate calls this directly)."""
    limit = None if objective == "continued_pretrain" else sequence_length + 1
    return _summarize(
        path=store.source,
        rows=store.records,
        segments=store.segments,
        roles=store.roles,
        lengths=store.lengths(),
        reason=lambda i: store.unusable_reason(i, limit),
        objective=objective,
        sequence_length=sequence_length,
        invalid=store.invalid,
        invalid_lines=store.invalid_lines,
    )


def _summarize(
    *,
    path: str,
    rows: np.ndarray,
    segments: np.ndarray,
    roles: list[str],
    lengths: np.ndarray,
    reason: Callable[[int], str],
    objective: Objective,
    sequence_length: int,
    invalid: Mapping[str, int] | None = None,
    invalid_lines: Sequence[InvalidLine] = (),
) -> InspectionReport:
    """Counts over whole columns; only the first MAX_PROBLEMS problems are read one by one.
    `invalid` counts the lines that are not records, by reason; `invalid_lines` names the
    first of them."""
    invalid = invalid or {}
    not_records = sum(invalid.values())
    text = objective == "continued_pretrain"
    kinds = np.asarray(rows["kind"])
    is_text = kinds == KINDS.index("text")
    wrong_kind = is_text != text
    zero = ~is_text & ~wrong_kind & np.asarray(rows["zero_target"])
    refused = ~is_text & ~wrong_kind & ~zero & ~np.asarray(rows["fits"])
    # Trained on: a supervised record read by a supervised objective that fits and has targets.
    usable = ~is_text & ~wrong_kind & np.asarray(rows["fits"]) & ~np.asarray(rows["zero_target"])
    shrunk = usable & ((rows["segments_dropped"] > 0) | (rows["segments_trimmed"] > 0))
    duplicate = _duplicates(np.asarray(rows["key"]))

    problems = [RecordProblem(line=i.line, reason=i.detail) for i in invalid_lines]
    candidates = np.flatnonzero(duplicate | wrong_kind | zero | refused)
    for i in candidates[:MAX_PROBLEMS].tolist():
        line = int(rows["line"][i])
        if duplicate[i]:
            problems.append(RecordProblem(line=line, reason="duplicate of an earlier record"))
        if wrong_kind[i]:
            problems.append(
                RecordProblem(line=line, reason=wrong_kind_reason(KINDS[kinds[i]], objective))
            )
        elif zero[i] or refused[i]:
            problems.append(RecordProblem(line=line, reason=reason(i)))
    problems.sort(key=lambda problem: problem.line)  # stable: a record's problems stay in order
    skipped = {
        "malformed_json": invalid.get("malformed_json", 0),
        "wrong_shape": invalid.get("wrong_shape", 0) + int(wrong_kind.sum()),
        "no_target": int(zero.sum()),
    }
    formats = {KINDS[k]: int(n) for k, n in zip(*np.unique(kinds, return_counts=True), strict=True)}
    order = sorted(formats, key=lambda kind: int(np.argmax(kinds == KINDS.index(kind))))
    return InspectionReport(
        path=path,
        objective=objective,
        sequence_length=sequence_length,
        formats={kind: formats[kind] for kind in order},
        records=len(rows) + not_records,
        fit=int((~wrong_kind & (is_text | usable)).sum()),
        refused=int((wrong_kind | refused).sum()) + not_records,
        trimmed=int(shrunk.sum()),
        tokens_trimmed=int(rows["tokens_trimmed"][shrunk].sum()),
        segments_dropped=int(rows["segments_dropped"][shrunk].sum()),
        zero_target=int(zero.sum()),
        duplicates=int(duplicate.sum()),
        source_end_lost_if_truncated=int((refused & (kinds == KINDS.index("pair"))).sum()),
        lengths=_lengths(rows),
        segments=[] if text else _survival(segments, roles, usable),
        problems=problems[:MAX_PROBLEMS],
        text_tokens=int(lengths.sum()) if text else None,
        oversized_records=int(refused.sum()),
        skipped_records={reason: n for reason, n in skipped.items() if n},
    )


def _duplicates(keys: np.ndarray) -> np.ndarray:
    """True for every record whose content hash an earlier record has."""
    if not len(keys):
        return np.zeros(0, bool)
    _, first = np.unique(keys, return_index=True)
    out = np.ones(len(keys), bool)
    out[first] = False
    return out


def wrong_kind_reason(kind: str, objective: str) -> str:
    """Why a `kind` record is of no use to `objective`."""
    if objective == "continued_pretrain":
        return f"a {kind} record where continued_pretrain reads text"
    return f"a text record where {objective} reads supervised records"


def _survival(segments: np.ndarray, roles: list[str], usable: np.ndarray) -> list[SegmentSurvival]:
    """Per (role, elasticity), in order of first appearance, how its segments fared."""
    if not len(segments):
        return []
    role, elastic = np.asarray(segments["role"]), np.asarray(segments["elastic"])
    fate = np.asarray(segments["fate"])
    kept_record = usable[np.asarray(segments["record"])]
    pair = role.astype(np.int64) * 8 + elastic
    _, first = np.unique(pair, return_index=True)
    out = []
    for i in sorted(first.tolist()):
        mine = pair == pair[i]
        code = int(elastic[i])
        out.append(
            SegmentSurvival(
                role=roles[int(role[i])],
                elastic=None if code == 0 else ELASTIC[code - 1],
                segments=int(mine.sum()),
                kept=int((mine & kept_record & (fate == KEPT)).sum()),
                trimmed=int((mine & kept_record & (fate == TRIMMED)).sum()),
                dropped=int((mine & kept_record & (fate == DROPPED)).sum()),
                refused=int((mine & ~kept_record).sum()),
            )
        )
    return out


def _stats(a: np.ndarray) -> LengthStats:
    if not len(a):
        return LengthStats(count=0, min=0, mean=0.0, p50=0, p90=0, p99=0, max=0)
    p50, p90, p99 = (int(np.percentile(a, q, method="higher")) for q in (50, 90, 99))
    return LengthStats(
        count=len(a),
        min=int(a.min()),
        mean=round(float(a.mean()), 2),
        p50=p50,
        p90=p90,
        p99=p99,
        max=int(a.max()),
    )


def _lengths(rows: np.ndarray) -> dict[str, LengthStats]:
    return {
        name: _stats(np.asarray(rows[f"{name}_tokens"])) for name in ("source", "target", "total")
    }


def _write_lines(path: Path, lines: Iterable[str]) -> int:
    """Write `lines` to `path` atomically (a temporary file in the same folder, renamed),
    streaming; zstd-compressed when the name ends in .zst, as the readers expect. Returns the
    number of lines written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    written = 0
    try:
        with os.fdopen(fd, "wb") as f:
            with contextlib.ExitStack() as stack:
                out: BinaryIO = f
                if path.name.endswith(".zst"):
                    import zstandard

                    writer = zstandard.ZstdCompressor(level=19).stream_writer(f, closefd=False)
                    out = stack.enter_context(writer)
                for line in lines:
                    out.write(line.encode("utf-8") + b"\n")
                    written += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return written
