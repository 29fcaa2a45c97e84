"""Dataset inspection: what training would make of a file, before a GPU hour is spent on it.

It runs the exact tokenizer and the one encoder (worker.encode) that training and evaluation
use, so "refused", "trimmed" and the lengths here are what training does, not an estimate.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from contracts.jobs import (
    InspectionReport,
    InspectRequest,
    LengthStats,
    RecordProblem,
    SegmentSurvival,
)
from contracts.workflow import Objective
from worker.encode import Encoded, encode_records
from worker.model import load_tokenizer
from worker.records import Record, read_records

MAX_PROBLEMS = 50  # problems listed with their line numbers; all are counted


def inspect_file(
    request: InspectRequest, *, write_fit: str | Path | None = None
) -> InspectionReport:
    """Inspect `request.path`. With `write_fit`, also write the records that training would
    take (the original lines, decompressed) to that file, atomically."""
    tokenizer = load_tokenizer(request.tokenizer)
    records = read_records(request.path)
    text = request.objective == "continued_pretrain"
    encoded = encode_records(
        tokenizer, records, sequence_length=None if text else request.sequence_length
    )
    report = summarize(
        records, encoded, objective=request.objective, sequence_length=request.sequence_length
    )
    if write_fit is not None:
        kept = [r.raw for r, e in zip(records, encoded, strict=True) if _trainable(r, e, text)]
        _write_lines(Path(write_fit), kept)
        report = report.model_copy(update={"fit_path": str(write_fit), "fit_written": len(kept)})
    return report


def _trainable(record: Record, encoded: Encoded, text: bool) -> bool:
    return record.kind == "text" if text else record.kind != "text" and encoded.usable


def summarize(
    records: Sequence[Record],
    encoded: Sequence[Encoded],
    *,
    objective: Objective,
    sequence_length: int,
) -> InspectionReport:
    """The report of already-encoded records (training's phase gate calls this directly)."""
    text = objective == "continued_pretrain"
    formats: dict[str, int] = {}
    problems: list[RecordProblem] = []
    seen: set[tuple[object, ...]] = set()
    fit = refused = trimmed = tokens_trimmed = dropped = zero = duplicates = 0
    source_end_lost = 0
    survival: dict[tuple[str, str | None], SegmentSurvival] = {}

    def problem(record: Record, reason: str) -> None:
        if len(problems) < MAX_PROBLEMS:
            problems.append(RecordProblem(line=record.line, reason=reason))

    for record, enc in zip(records, encoded, strict=True):
        formats[record.kind] = formats.get(record.kind, 0) + 1
        report = enc.report
        key = record.key()
        if key in seen:
            duplicates += 1
            problem(record, "duplicate of an earlier record")
        seen.add(key)
        if text or record.kind == "text":
            if text == (record.kind == "text"):
                fit += 1
            else:
                refused += 1
                problem(record, _wrong_kind(record.kind, objective))
            continue
        if report.zero_target:
            zero += 1
            problem(record, report.reason or "no target tokens")
        elif not report.fits:
            refused += 1
            problem(record, report.reason or "does not fit")
            if record.kind == "pair":
                source_end_lost += 1
        else:
            fit += 1
        if enc.usable and (report.dropped_segments or report.trimmed_segments):
            trimmed += 1
            tokens_trimmed += report.tokens_trimmed
            dropped += len(report.dropped_segments)
        if record.kind == "segmented":
            _count_survival(survival, record, enc)
    return InspectionReport(
        path=records[0].path if records else "",
        objective=objective,
        sequence_length=sequence_length,
        formats=formats,
        records=len(records),
        fit=fit,
        refused=refused,
        trimmed=trimmed,
        tokens_trimmed=tokens_trimmed,
        segments_dropped=dropped,
        zero_target=zero,
        duplicates=duplicates,
        source_end_lost_if_truncated=source_end_lost,
        lengths=_lengths(encoded),
        segments=list(survival.values()),  # roles in order of first appearance
        problems=problems,
        text_tokens=sum(len(e.ids) for e in encoded) if text else None,
    )


def _wrong_kind(kind: str, objective: str) -> str:
    if objective == "continued_pretrain":
        return f"a {kind} record where continued_pretrain reads text"
    return f"a text record where {objective} reads supervised records"


def _count_survival(
    survival: dict[tuple[str, str | None], SegmentSurvival], record: Record, enc: Encoded
) -> None:
    report = enc.report
    for i, segment in enumerate(record.segments):
        key = (segment.role, segment.elastic)
        entry = survival.get(key) or SegmentSurvival(
            role=segment.role,
            elastic=segment.elastic,
            segments=0,
            kept=0,
            trimmed=0,
            dropped=0,
            refused=0,
        )
        entry.segments += 1
        if not enc.usable:
            entry.refused += 1
        elif i in report.dropped_segments:
            entry.dropped += 1
        elif i in report.trimmed_segments:
            entry.trimmed += 1
        else:
            entry.kept += 1
        survival[key] = entry


def _stats(values: Sequence[int]) -> LengthStats:
    if not values:
        return LengthStats(count=0, min=0, mean=0.0, p50=0, p90=0, p99=0, max=0)
    a = np.asarray(values)
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


def _lengths(encoded: Sequence[Encoded]) -> dict[str, LengthStats]:
    return {
        "source": _stats([e.report.source_tokens for e in encoded]),
        "target": _stats([e.report.target_tokens for e in encoded]),
        "total": _stats([e.report.total_tokens for e in encoded]),
    }


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    """Write `lines` to `path` atomically (a temporary file in the same folder, renamed);
    zstd-compressed when the name ends in .zst, as the readers expect."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor(level=19).compress(data)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
