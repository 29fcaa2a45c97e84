"""`trainctl data inspect|prepare`: look at a data file, or tokenize it into its store, the way
training will (cli/job.py: here, or on a worker with `--remote`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import EXIT_FAILED, JsonOpt, call, console, err_console, fail
from cli.job import (
    Objective,
    RemoteOpt,
    TimeoutOpt,
    job_path,
    job_result,
    local,
    local_stores,
)
from cli.skipped import LEGEND, MARK, marked, reasons

data_app = typer.Typer(help="Look at data files the way training will.", no_args_is_help=True)

# The arguments of a data file as a phase reads it (`data inspect`, `data prepare`).
DataFileArg = Annotated[Path, typer.Argument(help="JSONL or plain-text data file (.zst too).")]
DataTokenizerOpt = Annotated[
    Path, typer.Option(help="tokenizer.json (or a folder holding one), as in the workflow.")
]
ObjectiveOpt = Annotated[
    Objective, typer.Option(help="continued_pretrain reads text; the others supervised records.")
]
SequenceLengthOpt = Annotated[
    int, typer.Option(min=1, help="The phase's (or source's) sequence_length.")
]


@data_app.command("inspect")
def data_inspect(
    file: DataFileArg,
    tokenizer: DataTokenizerOpt,
    objective: ObjectiveOpt,
    sequence_length: SequenceLengthOpt,
    write_fit: Annotated[
        Path | None,
        typer.Option(
            help="Write the records training would take to this file (the original lines), "
            "leaving out the refused ones and those with no target. Local only: not with --remote."
        ),
    ] = None,
    remote: RemoteOpt = False,
    timeout: TimeoutOpt = 600,
    as_json: JsonOpt = False,
) -> None:
    """Inspect a data file with the exact tokenizer and encoder of training: lengths, records
    that would be refused, trimmed or left with no target, duplicates, and how often each
    segment of segmented records survives. Exit 1 when records would be refused or have no
    target (unless --write-fit wrote a file without them)."""
    from contracts.jobs import InspectionReport, InspectRequest

    request = InspectRequest(
        path=job_path(file, remote),
        tokenizer=job_path(tokenizer, remote),
        objective=objective.value,
        sequence_length=sequence_length,
    )
    if remote:
        if write_fit is not None:
            raise fail("--write-fit writes a local file; run without --remote", 2)
        job = call(lambda api: api.inspect_dataset(request))
        result = job_result(job, f"inspection {job.id}", timeout=timeout)
        report = InspectionReport.model_validate(result)
    else:
        from worker.data.inspect import inspect_file

        report = local(
            lambda: inspect_file(
                request, write_fit=write_fit, stores=local_stores(request.tokenizer)
            )
        )
    if as_json:
        print(report.model_dump_json(indent=2))
    else:
        print_inspection(report)
    if (report.refused or report.zero_target) and write_fit is None:
        raise typer.Exit(EXIT_FAILED)


@data_app.command("prepare")
def data_prepare(
    file: DataFileArg,
    tokenizer: DataTokenizerOpt,
    objective: ObjectiveOpt,
    sequence_length: SequenceLengthOpt,
    remote: RemoteOpt = False,
    timeout: TimeoutOpt = 3600,
    as_json: JsonOpt = False,
) -> None:
    """Tokenize a data file into its token store ahead of time, once: the store a phase with
    this tokenizer, objective and sequence_length maps instead of building it before its first
    step. Locally the store goes under TRAINCTL_ARTIFACT_ROOT (default ~/.trainctl/artifacts),
    the embedded service's artifact store; with --remote, under the workers'."""
    from contracts.jobs import PreparedStore, PrepareRequest

    request = PrepareRequest(
        path=job_path(file, remote),
        tokenizer=job_path(tokenizer, remote),
        objective=objective.value,
        sequence_length=sequence_length,
    )
    if remote:
        job = call(lambda api: api.prepare_dataset(request))
        result = job_result(job, f"preparation {job.id}", timeout=timeout)
        prepared = PreparedStore.model_validate(result)
    else:
        from worker.data.store import prepare_file

        prepared = local(lambda: prepare_file(request, local_stores(request.tokenizer)))
    if as_json:
        print(prepared.model_dump_json(indent=2))
        return
    done = "built" if prepared.built else "already there, checked"
    console.print(
        f"{prepared.path}: {prepared.records:,} records, {prepared.tokens:,} tokens; store "
        f"{prepared.store} {done} in {prepared.seconds:.1f} s",
        soft_wrap=True,
        markup=False,
    )


def print_inspection(report: Any) -> None:
    formats = ", ".join(f"{n} {k}" for k, n in sorted(report.formats.items()))
    console.print(
        f"[bold]{report.path}[/bold]: {report.records} records ({formats}), objective "
        f"{report.objective}, sequence_length {report.sequence_length}"
    )
    if report.text_tokens is not None:
        windows = max(report.text_tokens - 1, 0) // report.sequence_length  # as training cuts
        console.print(f"text: {report.text_tokens:,} tokens, {windows:,} windows")
    lengths = Table(title="token lengths (as encoded, before fitting)")
    lengths.add_column("part")
    for column in ("min", "mean", "p50", "p90", "p99", "max"):
        lengths.add_column(column, justify="right")
    for part, s in report.lengths.items():
        lengths.add_row(
            part, str(s.min), f"{s.mean:.1f}", str(s.p50), str(s.p90), str(s.p99), str(s.max)
        )
    console.print(lengths)
    counts = Table(title="what training would do")
    counts.add_column("records")
    counts.add_column("count", justify="right")
    counts.add_column("share", justify="right")
    skipped = report.skipped_records
    for label, n in (
        ("fit (trained on)", report.fit),
        ("refused", report.refused),
        ("  too long", report.oversized_records),
        ("  malformed JSON", skipped.get("malformed_json", 0)),
        ("  wrong shape", skipped.get("wrong_shape", 0)),
        ("no target tokens", report.zero_target),
        ("trimmed or dropped elastic segments", report.trimmed),
        ("duplicates", report.duplicates),
        ("source end lost if truncated", report.source_end_lost_if_truncated),
    ):
        counts.add_row(label, f"{n:,}", f"{n / report.records:.1%}" if report.records else "-")
    console.print(counts)
    # As an eval set of this task at this sequence_length would count them (cli/skipped.py).
    left_out = report.oversized_records + sum(skipped.values())
    why = reasons(report.oversized_records, skipped)
    mark = marked(report.fit, report.oversized_records, skipped)
    console.print(
        f"as an eval set: {report.fit:,} records scored, {left_out:,} skipped"
        + (f" ({why})" if why else "")
        + (f" {MARK}\n{LEGEND}" if mark else ""),
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    if report.segments:
        segments = Table(title="segments of segmented records, by role")
        for column in ("role", "elastic", "segments", "kept", "trimmed", "dropped", "refused"):
            segments.add_column(column, justify="left" if column == "role" else "right")
        for s in report.segments:
            segments.add_row(
                s.role,
                s.elastic or "-",
                str(s.segments),
                str(s.kept),
                str(s.trimmed),
                str(s.dropped),
                str(s.refused),
            )
        console.print(segments)
    for problem in report.problems[:10]:
        err_console.print(f"  line {problem.line}: {problem.reason}", soft_wrap=True, markup=False)
    if len(report.problems) > 10:
        err_console.print(f"  ... and more ({len(report.problems)} listed with --json)")
    if report.fit_path is not None:
        left = report.records - (report.fit_written or 0)
        console.print(
            f"wrote {report.fit_written:,} records to {report.fit_path}; left out {left:,}"
        )
