"""Data and evaluation tools: `trainctl data inspect|prepare`, `trainctl eval` and the plan
table.

Each runs here by default, with the worker's own code (so the worker extra must be installed),
or on a worker through the API with `--remote` (paths are then the service's).
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    JsonOpt,
    call,
    console,
    err_console,
    fail,
    load_workflow,
    local,
    wait_for_job,
)

data_app = typer.Typer(help="Look at data files the way training will.", no_args_is_help=True)


class Objective(StrEnum):
    continued_pretrain = "continued_pretrain"
    summarization = "summarization"
    instruction_tuning = "instruction_tuning"
    qa_reasoning = "qa_reasoning"
    retrieval_planning = "retrieval_planning"


RemoteOpt = Annotated[
    bool,
    typer.Option(
        "--remote",
        help="Run on a worker through the API (TRAINCTL_API_URL); paths are the service's.",
    ),
]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds to wait for a --remote job.")]


def _path(path: Path, remote: bool) -> str:
    return str(path) if remote else str(path.resolve())


def _local_store_root() -> Path:
    """Where local tools keep token stores: the embedded service's artifact store
    (TRAINCTL_ARTIFACT_ROOT, default ~/.trainctl/artifacts), as its workers do, so a file
    inspected, prepared or evaluated here is not tokenized again by a run."""
    from worker.settings import WorkerSettings
    from worker.store import store_root

    return store_root(WorkerSettings().artifact_root)


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
            "leaving out the refused ones and those with no target."
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
        path=_path(file, remote),
        tokenizer=_path(tokenizer, remote),
        objective=objective.value,
        sequence_length=sequence_length,
    )
    if remote:
        if write_fit is not None:
            raise fail("--write-fit writes a local file; run without --remote", 2)
        job = call("POST", "/datasets/inspect", json=request.model_dump())
        job = wait_for_job(f"/datasets/inspections/{job['id']}", timeout=timeout)
        if job["status"] == "failed":  # the file or the request: bad input, as run locally
            raise fail(f"inspection {job['id']} failed: {job.get('error')}", EXIT_BAD_INPUT)
        report = InspectionReport.model_validate(job["result"])
    else:
        from worker.inspect import inspect_file
        from worker.model import load_tokenizer
        from worker.store import Stores

        report = local(
            lambda: inspect_file(
                request,
                write_fit=write_fit,
                stores=Stores(_local_store_root(), load_tokenizer(request.tokenizer)),
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
        path=_path(file, remote),
        tokenizer=_path(tokenizer, remote),
        objective=objective.value,
        sequence_length=sequence_length,
    )
    if remote:
        job = call("POST", "/datasets/prepare", json=request.model_dump())
        job = wait_for_job(f"/datasets/preparations/{job['id']}", timeout=timeout)
        if job["status"] == "failed":  # the file or the request: bad input, as run locally
            raise fail(f"preparation {job['id']} failed: {job.get('error')}", EXIT_BAD_INPUT)
        prepared = PreparedStore.model_validate(job["result"])
    else:
        from worker.model import load_tokenizer
        from worker.store import Stores, prepare_file

        prepared = local(
            lambda: prepare_file(
                request, Stores(_local_store_root(), load_tokenizer(request.tokenizer))
            )
        )
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
    for label, n in (
        ("fit (trained on)", report.fit),
        ("refused: too long", report.refused),
        ("no target tokens", report.zero_target),
        ("trimmed or dropped elastic segments", report.trimmed),
        ("duplicates", report.duplicates),
        ("source end lost if truncated", report.source_end_lost_if_truncated),
    ):
        counts.add_row(label, f"{n:,}", f"{n / report.records:.1%}" if report.records else "-")
    console.print(counts)
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


def eval_checkpoint(
    checkpoint: Annotated[
        Path, typer.Argument(help="A save_pretrained directory: a run's checkpoint, or any model.")
    ],
    workflow: Annotated[
        Path | None,
        typer.Option(
            help="Evaluate every eval set of this workflow file, with its tokenizer and each "
            "set's geometry (instead of --task, --data and --sequence-length)."
        ),
    ] = None,
    task: Annotated[Objective | None, typer.Option(help="The task whose loss to compute.")] = None,
    data: Annotated[Path | None, typer.Option(help="The task's eval file.")] = None,
    sequence_length: Annotated[
        int | None, typer.Option(min=1, help="Records longer than this are skipped and counted.")
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="Tokenizer; default: the workflow's, or the one saved in the checkpoint."
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Rows per forward pass (the number does not depend on it); default: each "
            "set's, or 8.",
        ),
    ] = None,
    remote: RemoteOpt = False,
    timeout: TimeoutOpt = 600,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate any checkpoint outside a run (a pre-SFT baseline, say): token-weighted,
    target-only cross-entropy and perplexity of one task, or of every eval set of a workflow,
    with the training objective."""
    from contracts.jobs import EvaluateRequest
    from contracts.reports import EvalResult

    if workflow is not None:
        if task is not None or data is not None or sequence_length is not None:
            raise fail(
                "--workflow takes each set's task, data and sequence_length from the workflow; "
                "leave out --task, --data and --sequence-length",
                EXIT_BAD_INPUT,
            )
        requests = _workflow_requests(checkpoint, workflow, tokenizer, batch_size, remote)
    else:
        if task is None or data is None or sequence_length is None:
            raise fail("give --task, --data and --sequence-length, or --workflow", EXIT_BAD_INPUT)
        requests = [
            EvaluateRequest(
                checkpoint=_path(checkpoint, remote),
                task=task.value,
                data=_path(data, remote),
                tokenizer=_path(tokenizer, remote) if tokenizer else None,
                sequence_length=sequence_length,
                batch_size=batch_size or 8,
            )
        ]
    if remote:
        # Every set's job is submitted before any is waited for, so workers take them at once.
        jobs = [call("POST", "/evaluations", json=r.model_dump()) for r in requests]
        results = []
        for request, job in zip(requests, jobs, strict=True):
            job = wait_for_job(f"/evaluations/{job['id']}", timeout=timeout)
            if job["status"] == "failed":
                name = request.name or request.task
                raise fail(
                    f"evaluation {job['id']} of eval set {name!r} failed: {job.get('error')}",
                    EXIT_BAD_INPUT,
                )
            results.append(EvalResult.model_validate(job["result"]))
    else:
        from worker.evaluate import evaluate_checkpoint_sets

        results = local(lambda: evaluate_checkpoint_sets(requests, store_root=_local_store_root()))
    if workflow is not None:
        if as_json:
            print(json.dumps([r.model_dump(mode="json") for r in results], indent=2))
        else:
            step = results[0].step  # one checkpoint: every result has its step
            console.print(f"{checkpoint} (step {step}):", soft_wrap=True, markup=False)
            console.print(eval_sets_table(results))
        return
    (result,) = results
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    console.print(
        f"{result.task}: cross-entropy {result.cross_entropy:.4f}, perplexity "
        f"{result.perplexity:.2f} over {result.target_tokens:,} target tokens of "
        f"{result.records:,} records ({result.oversized_records:,} too long, skipped); "
        f"checkpoint step {result.step}"
    )


def _workflow_requests(
    checkpoint: Path, path: Path, tokenizer: Path | None, batch_size: int | None, remote: bool
) -> list[Any]:
    """One request per eval set of the workflow file, in its order, at the set's geometry."""
    from contracts.jobs import EvaluateRequest
    from contracts.workflow import WorkflowInvalid, validate_workflow

    try:
        # Only the document: the eval files are read (and named when missing) where they are
        # evaluated, and the training data need not be there at all.
        spec = validate_workflow(load_workflow(path))
    except WorkflowInvalid as err:
        for problem in err.problems:
            err_console.print(f"[red]{path}[/red] {problem.path}: {problem.message}")
        raise typer.Exit(EXIT_BAD_INPUT) from err
    if not spec.evals:
        raise fail(f"{path}: the workflow has no eval sets (evals)", EXIT_BAD_INPUT)
    return [
        EvaluateRequest(
            checkpoint=_path(checkpoint, remote),
            task=e.task,
            data=e.data,
            name=e.name,
            tokenizer=_path(tokenizer, remote) if tokenizer else spec.tokenizer,
            sequence_length=spec.eval_sequence_length(e),
            batch_size=batch_size or e.batch_size,
        )
        for e in spec.evals
    ]


def eval_sets_table(results: list[Any]) -> Table:
    """A checkpoint's loss on each eval set: the baseline table of a workflow."""
    table = Table(box=None, pad_edge=False)
    # The set's name whole (`runs eval` answers by it); the task is cut short when narrow.
    table.add_column("set", no_wrap=True)
    table.add_column("task")
    for column in ("records", "oversized", "cross-entropy", "perplexity"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        table.add_row(
            r.name,
            r.task,
            f"{r.records:,}",
            f"{r.oversized_records:,}",
            f"{r.cross_entropy:.4f}",
            f"{r.perplexity:.2f}",
        )
    return table


def _tokens(count: int) -> str:
    """842137600 -> '842M', 36044800 -> '36.0M', 5120 -> '5.12k': three significant digits."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}{unit}"
    return str(count)


def plan_table(title: str, plan: Any) -> Table:
    """The plan of a workflow, within 80 columns: per phase (with its source's geometry), the
    sources of a mixture, and replay as a share of all compute tokens and of post-training
    tokens (contracts.workflow.Plan has the definitions and the exact counts)."""
    table = Table(
        title=f"{title}: {plan.total_steps:,} steps, {plan.compute_tokens:,} tokens",
        box=None,
        pad_edge=False,
        caption_justify="left",
    )
    table.caption = (
        f"replay {plan.replay_tokens:,} tokens: {plan.replay_token_share:.1%} of all tokens, "
        f"{plan.post_training_replay_share:.1%} of {plan.post_training_tokens:,} post-training "
        "tokens (supervised and replay phases). share: a phase's of the run's tokens, a "
        "source's of its phase's; replay: of the phase's tokens"
    )
    table.add_column("phase / source")
    table.add_column("objective", no_wrap=True)
    for column in ("steps", "tokens", "share", "replay"):
        table.add_column(column, justify="right", no_wrap=True)
    for p in plan.phases:
        mixture = len(p.sources) > 1
        geometry = (
            "" if mixture else f" {p.sources[0].sequence_length}x{p.sources[0].microbatch_size}"
        )
        table.add_row(
            f"[bold]{p.name}[/bold]{geometry}{' (replay)' if p.role == 'replay' else ''}",
            p.objective,
            f"{p.first_step}-{p.last_step}",
            _tokens(p.compute_tokens),
            f"{p.token_share:.1%}",
            f"{p.replay_token_share:.1%}" if p.replay_token_share else "",
        )
        for s in p.sources if mixture else []:
            table.add_row(
                f"  {s.name} {s.sequence_length}x{s.microbatch_size}",
                s.objective,
                "",
                _tokens(s.compute_tokens),
                f"{s.token_share:.1%}",
                "",
            )
    return table
