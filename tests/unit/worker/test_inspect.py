"""Dataset inspection: what training would make of a file, with training's own encoder."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from contracts.jobs import InspectionReport, InspectRequest, LengthStats, SegmentSurvival
from contracts.workflow import EvalSpec, InspectionGate, Phase
from worker.data.batch import load_phase_data
from worker.data.encode import encode_records
from worker.data.inspect import inspect_file, summarize
from worker.data.records import read_records
from worker.error import DataError
from worker.train.evaluate import load_eval_data

SEQ = 32
PASSAGE = " the cat sat on the mat"
SHORT = " the dog ran"


def rag(first: str, second: str, *, elastic: bool = True, instruction: str = "Answer.\n") -> dict:
    return {
        "segments": [
            {"text": instruction, "role": "instruction"},
            {"text": first, "role": "passage", "elastic": elastic},
            {"text": second, "role": "passage", "elastic": elastic},
            {"text": "\nWhere?", "role": "question"},
        ],
        "target": " on the mat",
    }


MIXED: list[dict[str, Any]] = [
    {"source": "reverse cat dog:", "target": " dog cat"},  # 1 fit
    {"target": " dog cat", "source": "reverse cat dog:"},  # 2 fit, duplicate of 1
    {"source": "the cat sat on the mat " * 6, "target": " mat"},  # 3 refused
    {"source": "the cat", "target": ""},  # 4 zero target
    rag(PASSAGE, SHORT * 6),  # 5 fit after dropping the last passage
    rag(PASSAGE * 2, SHORT * 6),  # 6 fit after dropping both passages
    rag(SHORT, SHORT, elastic=False, instruction="Answer." * 20),  # 7 refused
    {
        "messages": [
            {"role": "user", "content": "the cat?"},
            {"role": "assistant", "content": "sat"},
        ]
    },  # 8 fit
    {"text": "the cat sat"},  # 9 refused: text where supervised records are read
    rag(SHORT, SHORT),  # 10 fit as written
]
FITTING_LINES = [1, 2, 5, 6, 8, 10]


def request(path: Path, tokenizer_path: Path, objective: str = "qa_reasoning") -> InspectRequest:
    return InspectRequest(
        path=str(path), tokenizer=str(tokenizer_path), objective=objective, sequence_length=SEQ
    )


@pytest.fixture
def mixed_file(tmp_path: Path, make_jsonl: Callable[..., Path]) -> Path:
    return make_jsonl(tmp_path / "mixed.jsonl", MIXED)


def test_the_mixed_file_is_what_the_test_says_it_is(mixed_file: Path, tokenizer: Tokenizer) -> None:
    encoded = encode_records(tokenizer, read_records(str(mixed_file)), sequence_length=SEQ)
    usable = [i + 1 for i, e in enumerate(encoded) if e.usable and i + 1 != 9]
    assert usable == FITTING_LINES
    assert encoded[4].report.dropped_segments == (2,)
    assert encoded[5].report.dropped_segments == (1, 2)
    assert encoded[6].report.dropped_segments == () and not encoded[6].report.fits


def test_inspection_counts_what_training_would_refuse_trim_and_repeat(
    mixed_file: Path, tokenizer_path: Path, tokenizer: Tokenizer
) -> None:
    report = inspect_file(request(mixed_file, tokenizer_path))
    encoded = encode_records(tokenizer, read_records(str(mixed_file)), sequence_length=SEQ)
    assert report.path == str(mixed_file)
    assert (report.objective, report.sequence_length) == ("qa_reasoning", SEQ)
    assert report.formats == {"pair": 4, "segmented": 4, "chat": 1, "text": 1}
    assert report.records == 10
    assert report.fit == len(FITTING_LINES)
    assert report.refused == 3  # lines 3, 7 and 9
    assert report.zero_target == 1
    assert report.duplicates == 1
    assert report.trimmed == 2
    assert report.segments_dropped == 3
    assert report.tokens_trimmed == encoded[4].report.part_tokens[2] + sum(
        encoded[5].report.part_tokens[1:3]
    )
    # Only line 3 is a plain pair too long: a naive encoder would cut its source's end.
    assert report.source_end_lost_if_truncated == 1
    assert [p.line for p in report.problems] == [2, 3, 4, 7, 9]
    reasons = {p.line: p.reason for p in report.problems}
    assert reasons[2] == "duplicate of an earlier record"
    assert reasons[3] == encoded[2].report.reason
    assert "no target tokens" in reasons[4]
    assert "text record" in reasons[9]
    assert report.text_tokens is None
    assert (report.fit_path, report.fit_written) == (None, None)


def test_inspection_reports_length_distributions_before_fitting(
    mixed_file: Path, tokenizer_path: Path, tokenizer: Tokenizer
) -> None:
    report = inspect_file(request(mixed_file, tokenizer_path))
    encoded = encode_records(tokenizer, read_records(str(mixed_file)), sequence_length=SEQ)
    columns = {
        "source": [e.report.source_tokens for e in encoded],
        "target": [e.report.target_tokens for e in encoded],
        "total": [e.report.total_tokens for e in encoded],
    }
    assert set(report.lengths) == set(columns)
    for name, values in columns.items():
        ordered = sorted(values)
        n = len(values)

        def at(q: float, ordered: list[int] = ordered, n: int = n) -> int:
            return ordered[math.ceil(q * (n - 1))]

        assert report.lengths[name] == LengthStats(
            count=n,
            min=ordered[0],
            mean=round(sum(values) / n, 2),
            p50=at(0.5),
            p90=at(0.9),
            p99=at(0.99),
            max=ordered[-1],
        ), name
    # Totals are measured as written: the fitted record 6 counts at its full length.
    assert report.lengths["total"].max > SEQ + 1
    assert columns["total"][5] == sum(encoded[5].report.part_tokens) + columns["target"][5] + 1


def test_inspection_reports_how_each_segment_role_survives(
    mixed_file: Path, tokenizer_path: Path
) -> None:
    report = inspect_file(request(mixed_file, tokenizer_path))

    def survival(role: str, elastic: str | None, **counts: int) -> SegmentSurvival:
        zero = {"kept": 0, "trimmed": 0, "dropped": 0, "refused": 0}
        return SegmentSurvival(role=role, elastic=elastic, **{**zero, **counts})

    # Segmented lines: 5 (drops its last passage), 6 (drops both), 7 (refused: its segments
    # are lost with it; its passages are not elastic), 10 (kept whole). By role, in order of
    # first appearance.
    assert report.segments == [
        survival("instruction", None, segments=4, kept=3, refused=1),
        survival("passage", "drop", segments=6, kept=3, dropped=3),
        survival("question", None, segments=4, kept=3, refused=1),
        survival("passage", None, segments=2, refused=2),
    ]


def test_a_trimmed_segment_is_counted_as_trimmed(
    tmp_path: Path, tokenizer_path: Path, make_jsonl: Callable[..., Path]
) -> None:
    def record(passage: str) -> dict[str, Any]:
        return {
            "segments": [
                {"text": passage, "role": "passage", "elastic": "start"},
                {"text": "\nWhere?", "role": "question"},
            ],
            "target": " there",
        }

    path = make_jsonl(tmp_path / "trim.jsonl", [record(SHORT), record(PASSAGE * 6)])
    report = inspect_file(request(path, tokenizer_path))
    assert (report.fit, report.trimmed, report.segments_dropped) == (2, 1, 0)
    assert report.tokens_trimmed > 0
    assert [(s.role, s.segments, s.kept, s.trimmed, s.dropped) for s in report.segments] == [
        ("passage", 2, 1, 1, 0),
        ("question", 2, 2, 0, 0),
    ]


def test_a_refused_record_is_not_counted_as_trimmed(
    tmp_path: Path, tokenizer_path: Path, make_jsonl: Callable[..., Path]
) -> None:
    # Its passages are dropped while trying to fit it, but it still does not fit: training
    # refuses it, so nothing was "trimmed to fit" (InspectionReport.trimmed, and the gate's
    # max_trimmed_share, count records that fit only after trimming).
    refused = rag(PASSAGE, SHORT, instruction="Answer." * 20)
    path = make_jsonl(tmp_path / "refused.jsonl", [refused, rag(SHORT, SHORT)])
    report = inspect_file(request(path, tokenizer_path))
    assert (report.fit, report.refused) == (1, 1)
    assert report.trimmed == 0
    assert report.segments_dropped == 0
    assert report.tokens_trimmed == 0


def test_write_fit_writes_exactly_the_records_that_fit_and_says_how_many(
    tmp_path: Path, mixed_file: Path, tokenizer_path: Path, make_zst: Callable[[Path], Path]
) -> None:
    out = tmp_path / "out" / "fit.jsonl"
    compressed = make_zst(mixed_file)
    report = inspect_file(request(compressed, tokenizer_path), write_fit=out)
    original = mixed_file.read_text().splitlines()
    assert out.read_text().splitlines() == [original[n - 1] for n in FITTING_LINES]
    assert (report.fit_path, report.fit_written) == (str(out), len(FITTING_LINES))
    assert report.records - len(FITTING_LINES) == 4  # what it left out
    assert [p.name for p in out.parent.iterdir()] == ["fit.jsonl"]  # no temporary file left

    again = inspect_file(request(out, tokenizer_path))
    assert (again.records, again.fit, again.refused, again.zero_target) == (6, 6, 0, 0)


def test_inspecting_pretraining_text_counts_its_tokens_and_refuses_other_records(
    tmp_path: Path, tokenizer_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "text.jsonl"
    lines = ['{"text": "the cat sat"}', '{"source": "a", "target": " b"}', '{"text": "the dog"}']
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit.jsonl"
    report = inspect_file(request(path, tokenizer_path, "continued_pretrain"), write_fit=out)
    assert (report.records, report.fit, report.refused) == (3, 2, 1)
    assert report.problems[0].line == 2
    assert "continued_pretrain reads text" in report.problems[0].reason
    encoded = encode_records(tokenizer, read_records(str(path)), sequence_length=None)
    assert report.text_tokens == sum(len(e.ids) for e in encoded)
    assert out.read_text().splitlines() == [lines[0], lines[2]]
    assert report.fit_written == 2


# --- the phase gate -------------------------------------------------------------------------


def gated_phase(path: Path, **gate: float) -> Phase:
    return Phase.model_validate(
        {
            "name": "rag",
            "objective": "qa_reasoning",
            "data": [{"path": str(path)}],
            "sequence_length": SEQ,
            "microbatch_size": 4,
            "steps": 5,
            "inspection": gate,
        }
    )


@pytest.mark.parametrize(
    ("gate", "failure"),
    [
        (
            {"max_duplicate_share": 0.1},
            "25.0% of records are duplicates, more than max_duplicate_share 10.0%",
        ),
        (
            {"max_trimmed_share": 0.2},
            "50.0% of records were trimmed to fit, more than max_trimmed_share 20.0%",
        ),
    ],
)
def test_a_failing_inspection_gate_stops_the_phase_before_its_first_step(
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    gate: dict[str, float],
    failure: str,
) -> None:
    rows = [
        rag(PASSAGE * 2, SHORT * 3),
        rag(SHORT, SHORT),
        rag(SHORT, SHORT),
        rag(PASSAGE, SHORT * 6),
    ]
    path = make_jsonl(tmp_path / "rag.jsonl", rows)
    expected = f"{path}: inspection required by phase 'rag' failed: {failure}"
    with pytest.raises(DataError, match=f"^{re.escape(expected)}"):
        load_phase_data(gated_phase(path, **gate), tokenizer)


def test_a_passing_inspection_gate_keeps_its_report(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    path = make_jsonl(tmp_path / "rag.jsonl", [rag(PASSAGE * 2, SHORT * 3), rag(SHORT, SHORT)])
    data = load_phase_data(gated_phase(path, max_trimmed_share=0.5), tokenizer)
    (report,) = data.reports
    assert (report.path, report.records, report.fit, report.trimmed) == (str(path), 2, 2, 1)


def test_refused_and_targetless_records_always_fail_a_gate(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    path = make_jsonl(tmp_path / "bad.jsonl", MIXED[2:4])
    records = read_records(str(path))
    encoded = encode_records(tokenizer, records, sequence_length=SEQ)
    report: InspectionReport = summarize(
        records, encoded, objective="summarization", sequence_length=SEQ
    )
    assert report.gate_failures(InspectionGate()) == [
        "1 records cannot be encoded within sequence_length",
        "1 records have no target tokens",
    ]


def test_inspection_counts_what_an_eval_set_would_skip_by_reason(
    tmp_path: Path, tokenizer_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in MIXED] + ["{oops", '{"source": "cat"}', "[1]"]
    path.write_text("".join(line + "\n" for line in lines))
    report = inspect_file(request(path, tokenizer_path))
    # As evaluation of a qa_reasoning set at SEQ skips them, and as training refuses them.
    assert report.skipped_records == {"malformed_json": 1, "wrong_shape": 3, "no_target": 1}
    assert report.oversized_records == 2
    spec = EvalSpec.model_validate({"task": "qa_reasoning", "data": str(path)})
    data = load_eval_data(tokenizer, spec, sequence_length=SEQ)
    assert (data.records, data.oversized_records, data.skipped_records) == (
        report.fit,
        report.oversized_records,
        report.skipped_records,
    )
    assert (report.records, report.fit) == (13, len(FITTING_LINES))
    assert report.refused == 2 + 1 + 3  # too long, the text record, the three lines
    assert report.formats == {"pair": 4, "segmented": 4, "chat": 1, "text": 1}
    problems = [(p.line, p.reason) for p in report.problems if p.line > 10]
    assert problems[:2] == [
        (11, "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (12, "missing field 'target'"),
    ]
    assert problems[2][0] == 13 and problems[2][1].startswith("expected a JSON object")
    assert [p.line for p in report.problems] == sorted(p.line for p in report.problems)
