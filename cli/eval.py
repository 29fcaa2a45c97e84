"""`trainctl eval`: evaluate any checkpoint outside a run, on one task or on every eval set of
a workflow (cli/job.py: here, or on a worker with `--remote`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import (
    EXIT_BAD_INPUT,
    JsonOpt,
    call,
    console,
    fail,
    load_workflow,
    refuse_workflow,
)
from cli.job import (
    Objective,
    RemoteOpt,
    TimeoutOpt,
    job_path,
    job_result,
    local,
    local_store_root,
)
from cli.skipped import notes, reasons, skipped_cells


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
                checkpoint=job_path(checkpoint, remote),
                task=task.value,
                data=job_path(data, remote),
                tokenizer=job_path(tokenizer, remote) if tokenizer else None,
                sequence_length=sequence_length,
                batch_size=batch_size or 8,
            )
        ]
    if remote:
        # Every set's job is submitted before any is waited for, so workers take them at once.
        jobs = call(lambda api: [api.evaluate(r) for r in requests])
        results = []
        for request, job in zip(requests, jobs, strict=True):
            name = request.name or request.task
            what = f"evaluation {job.id} of eval set {name!r}"
            result = job_result(job, what, timeout=timeout)
            results.append(EvalResult.model_validate(result))
    else:
        from worker.train.evaluate import evaluate_checkpoint_sets

        results = local(lambda: evaluate_checkpoint_sets(requests, store_root=local_store_root()))
    if workflow is not None:
        if as_json:
            print(json.dumps([r.model_dump(mode="json") for r in results], indent=2))
        else:
            step = results[0].step  # one checkpoint: every result has its step
            console.print(f"{checkpoint} (step {step}):", soft_wrap=True, markup=False)
            console.print(eval_sets_table(results))
            _print_notes(results, why=True)
        return
    (result,) = results
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    skipped = reasons(result.oversized_records, result.skipped_records) or "none"
    console.print(
        f"{result.task}: cross-entropy {result.cross_entropy:.4f}, perplexity "
        f"{result.perplexity:.2f} over {result.target_tokens:,} target tokens of "
        f"{result.records:,} records (skipped: {skipped}); checkpoint step {result.step}",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    _print_notes([result], why=False)


def _print_notes(results: list[Any], *, why: bool) -> None:
    sets = [(r.name, r.model_dump(), r.skipped_examples) for r in results]
    for line in notes(sets, why=why):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


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
        raise refuse_workflow(path, err) from err
    if not spec.evals:
        raise fail(f"{path}: the workflow has no eval sets (evals)", EXIT_BAD_INPUT)
    return [
        EvaluateRequest(
            checkpoint=job_path(checkpoint, remote),
            task=e.task,
            data=e.data,
            name=e.name,
            tokenizer=job_path(tokenizer, remote) if tokenizer else spec.tokenizer,
            sequence_length=spec.eval_sequence_length(e),
            batch_size=batch_size or e.batch_size,
        )
        for e in spec.evals
    ]


def eval_sets_table(results: list[Any]) -> Table:
    """A checkpoint's loss on each eval set: the baseline table of a workflow, with the records
    each set scored and skipped (why, below it: cli/skipped.py)."""
    table = Table(box=None, pad_edge=False)
    # The set's name whole (`runs eval` answers by it); the task is cut short when narrow.
    table.add_column("set", no_wrap=True)
    table.add_column("task")
    for column in ("scored", "skipped", "cross-entropy", "perplexity"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        scored, skipped, _ = skipped_cells(r.records, r.oversized_records, r.skipped_records)
        table.add_row(
            r.name, r.task, scored, skipped, f"{r.cross_entropy:.4f}", f"{r.perplexity:.2f}"
        )
    return table
