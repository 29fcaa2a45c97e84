"""`trainctl runs`: create, resume, control, list, update, compare, export, show, watch and
evaluate runs, through the API."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import (
    EXIT_API,
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    JsonOpt,
    RunId,
    call,
    console,
    err_console,
    fail,
    jsonable,
    load_workflow,
    print_json,
)
from cli.table import SHORTEN, Column, FittedTable, number, text
from client import Client
from contracts.api import MAX_RUNS_PAGE, RunPublic, RunsPublic

runs_app = typer.Typer(help="Create, list and inspect runs.", no_args_is_help=True)


WAITING_FOR_WORKER = (
    "waiting for a worker: none was heard from within the lease period; start one "
    "(`trainctl worker`) and check `trainctl workers`"
)


def waiting_text(run: dict[str, Any]) -> str:
    """Why a run waits for a worker, as the service says (`waiting_reason`), and what to do."""
    from cli.watch import waiting_reason

    reason = waiting_reason(run)
    if reason is None:
        return WAITING_FOR_WORKER
    return (
        f"waiting for a worker: {reason}; start one that can take it (`trainctl worker`) and "
        "check `trainctl workers`"
    )


# The most runs one `GET /runs` answers.
RUNS_PAGE = MAX_RUNS_PAGE


@runs_app.command("create")
def runs_create(
    path: Annotated[Path, typer.Argument(help="Workflow JSON file.")],
    name: Annotated[str | None, typer.Option(help="A name for the run.")] = None,
    initial_checkpoint: Annotated[
        Path | None, typer.Option(help="Safetensors file or model directory to start from.")
    ] = None,
    from_run: Annotated[
        str | None,
        typer.Option(
            help="Start from another run's checkpoint: the one at --step, or its best "
            "checkpoint of the eval set --best."
        ),
    ] = None,
    step: Annotated[int | None, typer.Option(min=0, help="With --from-run: its step.")] = None,
    best: Annotated[
        str | None,
        typer.Option(help="With --from-run: the eval set whose best checkpoint to start from."),
    ] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retry-safe key: the same key returns the same run.")
    ] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            help="Placement priority: higher is placed first and may preempt lower running "
            "runs (default 0)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a workflow as a new run."""
    doc = load_workflow(path)
    start: str | dict[str, Any] | None = None
    if initial_checkpoint:
        start = str(initial_checkpoint.resolve())
    if from_run is not None or step is not None or best is not None:
        if from_run is None or initial_checkpoint or (step is None) == (best is None):
            raise fail(
                "give --from-run RUN with one of --step N or --best SET (and no "
                "--initial-checkpoint)",
                EXIT_BAD_INPUT,
            )
        start = {"run": from_run, **({"step": step} if best is None else {"best": best})}
    run = call(
        lambda api: api.create_run(
            doc,
            name=name or None,
            initial_checkpoint=start,
            idempotency_key=idempotency_key,
            priority=priority,
        )
    )
    if as_json:
        print_json(run)
    else:
        console.print(f"created run [bold]{run.id}[/bold] ({run.total_steps} steps)")


@runs_app.command("resume")
def runs_resume(
    run_id: RunId,
    workflow: Annotated[
        Path | None,
        typer.Option(help="Workflow JSON file; omitted: the run's stored workflow."),
    ] = None,
    initial_checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="Safetensors file or model directory the run started from (it may have "
            "moved; its content must not change); omitted: the stored digest."
        ),
    ] = None,
    devices: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Devices (torch.distributed ranks) to go on on, from this attempt to the end "
            "of the run; each remaining phase's grad_accum must be a multiple of it. Not part "
            "of the signature. Omitted: the run's current count.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Continue a stopped run under its id from its latest checkpoint. What is given must
    reproduce the run's signature; a mismatch names every differing field (exit 3)."""
    doc = load_workflow(workflow) if workflow else None
    start = str(initial_checkpoint.resolve()) if initial_checkpoint else None
    run = call(
        lambda api: api.resume_run(run_id, workflow=doc, initial_checkpoint=start, devices=devices)
    )
    if as_json:
        print_json(run)
        return
    if run.status == "succeeded":
        console.print(f"run [bold]{run.id}[/bold] already succeeded; nothing to resume")
        return
    attempt = max(run.attempts, key=lambda a: a.number)
    ckpt = run.latest_checkpoint
    begin = f"the checkpoint at step {ckpt.step}" if ckpt else "the start"
    on = attempt.devices
    console.print(
        f"resumed run [bold]{run.id}[/bold]: attempt {attempt.number} continues phase "
        f"{run.phase} from {begin} on {on} device{'s' if on != 1 else ''}"
    )


def _control(run: RunPublic, as_json: bool) -> None:
    if as_json:
        print_json(run)
    else:
        console.print(f"run [bold]{run.id}[/bold]: {run.status}")


@runs_app.command("pause")
def runs_pause(run_id: RunId, as_json: JsonOpt = False) -> None:
    """Ask the worker to checkpoint and stop; `runs resume` continues from that checkpoint."""
    _control(call(lambda api: api.pause_run(run_id)), as_json)


@runs_app.command("cancel")
def runs_cancel(run_id: RunId, as_json: JsonOpt = False) -> None:
    """Stop a run now, without a new checkpoint; `runs resume` can still continue it from its
    latest checkpoint."""
    _control(call(lambda api: api.cancel_run(run_id)), as_json)


class RunStatusOpt(StrEnum):
    queued = "queued"
    running = "running"
    recovering = "recovering"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


@runs_app.command("list")
def runs_list(
    limit: Annotated[
        int, typer.Option(min=0, help="Show at most this many runs (0: every run).")
    ] = 50,
    status: Annotated[RunStatusOpt | None, typer.Option(help="Only runs in this status.")] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option(help="Only runs carrying this tag (repeat: every one of them)."),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Only runs whose name holds this text (any case).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first, following the API's pages up to --limit."""
    filters: dict[str, Any] = {
        "status": status.value if status else None,
        "tags": tag,
        "name": name,
    }

    def pages(api: Client) -> RunsPublic:
        answer = api.list_runs(**filters, limit=min(limit or RUNS_PAGE, RUNS_PAGE))
        while answer.next_cursor and (limit == 0 or len(answer.runs) < limit):
            want = RUNS_PAGE if limit == 0 else min(limit - len(answer.runs), RUNS_PAGE)
            page = api.list_runs(**filters, limit=want, cursor=answer.next_cursor)
            answer = page.model_copy(update={"runs": answer.runs + page.runs})
        return answer

    answer = call(pages)
    if as_json:
        print_json(answer)
        return
    console.print(runs_table(jsonable(answer)["runs"]))
    if answer.next_cursor:
        console.print(f"the {len(answer.runs)} newest of {answer.count}; --limit 0 lists all")


def local_time(iso: str) -> str:
    """An API timestamp in this machine's time zone, to the minute."""
    return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")


def runs_table(runs: list[dict[str, Any]]) -> FittedTable:
    """A row per run. Narrower than it needs (80 columns), the names, statuses, phases and
    tags are shortened, then the created time, the tags, restarts and phase dropped, before
    an id or a number is cut."""
    columns = [
        Column("id", whole=True),
        text("name", min_width=10),
        text("status", min_width=9),
        text("phase", min_width=8, drop=SHORTEN + 3),
        number("step"),
        number("prio", drop=SHORTEN + 4),
        number("queue", drop=SHORTEN + 4),
        number("restarts", drop=SHORTEN + 2),
        text("tags", min_width=8, drop=SHORTEN + 1),
        Column("created", whole=True, drop=SHORTEN),
    ]
    rows = [
        [
            run["id"],
            run.get("name") or "",
            run["status"] + (" (no worker)" if run.get("waiting_for_worker") else ""),
            run.get("phase") or "",
            f"{run['step']}/{run['total_steps']}",
            str(run.get("priority", 0)),
            "" if run.get("queue_position") is None else f"#{run['queue_position']}",
            str(run.get("restarts", 0) + run.get("preemptions", 0)),
            ", ".join(run.get("tags") or []),
            local_time(run["created_at"]),
        ]
        for run in runs
    ]
    return FittedTable(columns, rows)


@runs_app.command("update")
def runs_update(
    run_id: RunId,
    name: Annotated[str | None, typer.Option(help="A new name for the run.")] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option(help="The run's tags (repeat for several; replaces the set)."),
    ] = None,
    clear_tags: Annotated[
        bool, typer.Option("--clear-tags", help="Remove every tag of the run.")
    ] = False,
    note: Annotated[str | None, typer.Option(help='A note about the run ("" removes it).')] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            help="Placement priority: higher is placed first and may preempt lower running runs."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Set a run's name, tags, note or priority (PATCH /runs/{id}); what is not given
    stays."""
    tags = [] if clear_tags else tag or None
    if name is None and tags is None and note is None and priority is None:
        raise fail("give --name, --tag, --clear-tags, --note or --priority", EXIT_BAD_INPUT)
    run = call(
        lambda api: api.update_run(run_id, name=name, tags=tags, note=note, priority=priority)
    )
    if as_json:
        print_json(run)
        return
    shown = ", ".join(run.tags) or "none"
    console.print(f"run {run.id} {run.name!r}: tags {shown}, priority {run.priority}", markup=False)
    if run.note:
        console.print(f"note: {run.note}", markup=False)


@runs_app.command("priority")
def runs_priority(
    run_id: RunId,
    priority: Annotated[int, typer.Argument(help="Higher is placed first (default 0).")],
    as_json: JsonOpt = False,
) -> None:
    """Set a run's placement priority: its queued attempts are placed in the new order, and
    a higher one may preempt lower running ones (they checkpoint, yield and queue again)."""
    run = call(lambda api: api.update_run(run_id, priority=priority))
    if as_json:
        print_json(run)
        return
    where = "" if run.queue_position is None else f", queue position {run.queue_position}"
    console.print(f"run {run.id}: priority {run.priority}{where}", markup=False)


@runs_app.command("compare")
def runs_compare(
    run_ids: Annotated[
        list[str],
        typer.Argument(help="Two or more run ids; the first is the reference."),
    ],
    show_all: Annotated[
        bool,
        typer.Option(
            "--all", help="Show every differing input; by default a long group shows its first."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compare runs: per eval set each run's baseline, final and best perplexity and its
    change against the first run, then the runs, then every signed input that differs, by
    group (data files added, removed or changed; per-phase fields; optimizer; evals; other)
    with each run's value."""
    from cli.compare import FOLD_AFTER, comparison_view

    if len(run_ids) < 2:
        raise fail("give two or more run ids to compare", EXIT_BAD_INPUT)
    answer = jsonable(call(lambda api: api.compare(run_ids)))
    if as_json:
        print_json(answer)
        return
    console.print(comparison_view(answer, fold_after=None if show_all else FOLD_AFTER))


@runs_app.command("export")
def runs_export(
    run_id: RunId,
    directory: Annotated[
        Path, typer.Argument(help="Folder to write metrics.csv and evals.csv into (made).")
    ],
    max_points: Annotated[
        int | None,
        typer.Option(min=1, help="Thin each metric series to this many points (default all)."),
    ] = None,
) -> None:
    """Write the run's metrics and evaluations as CSV: DIR/metrics.csv
    (run_id,name,step,value) and DIR/evals.csv (run_id,name,task,step,phase,cross_entropy,
    perplexity,records,target_tokens,oversized_records,skipped_<reason>...); docs/operations.md
    has the columns."""
    from cli.common import client
    from cli.compare import count_rows, export_paths
    from client import ApiError

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise fail(f"cannot make {directory}: {err}", EXIT_BAD_INPUT) from err
    paths = export_paths(directory)
    try:
        with client() as api:
            api.download_metrics_csv(run_id, paths["metrics"], max_points=max_points)
            api.download_eval_csv(run_id, paths["evals"])
    except ApiError as err:
        raise fail(f"{err.message} [{err.code}]", EXIT_API) from err
    except OSError as err:
        raise fail(f"cannot write into {directory}: {err}", EXIT_BAD_INPUT) from err
    for what, path in paths.items():
        console.print(f"{what}: {path} ({count_rows(path)} rows)", markup=False)


@runs_app.command("show")
def runs_show(run_id: RunId, as_json: JsonOpt = False) -> None:
    """Show one run: status, progress, latest checkpoint and attempts."""
    run = jsonable(call(lambda api: api.get_run(run_id)))
    if as_json:
        print_json(run)
        return
    cause = f" ({run['cause']}: {run.get('message')})" if run.get("cause") else ""
    console.print(f"[bold]{run['id']}[/bold] {run['status']}{cause}")
    if run.get("waiting_for_worker"):
        console.print(waiting_text(run), style="yellow", markup=False)
    if run.get("preparing"):
        from cli.watch import preparing_text

        console.print(preparing_text(run["preparing"]), markup=False)
    console.print(f"phase {run.get('phase')}  step {run['step']}/{run['total_steps']}")
    if run.get("tags"):
        console.print(f"tags: {', '.join(run['tags'])}", markup=False)
    if run.get("note"):
        console.print(f"note: {run['note']}", markup=False)
    ckpt = run.get("latest_checkpoint")
    console.print(f"latest checkpoint: {ckpt['path'] if ckpt else '-'}")
    if source := run.get("initial_checkpoint_from"):
        of = f" (best of eval set {source['best']!r})" if source.get("best") else ""
        console.print(
            f"initial checkpoint: run {source['run']} step {source['step']}{of}", markup=False
        )
    elif run.get("initial_checkpoint"):
        console.print(f"initial checkpoint: {run['initial_checkpoint']}", markup=False)
    for a in run.get("attempts", []):
        resent = f", message sent again {n}x" if (n := a.get("redispatches")) else ""
        console.print(
            f"  attempt {a['number']} phase {a['phase_index']} {a['status']} "
            f"on {a.get('worker_hostname') or '-'} pid {a.get('worker_pid') or '-'} "
            f"({a.get('devices', 1)} dev{resent})"
        )


@runs_app.command("watch")
def runs_watch(
    run_id: RunId,
    timeout: Annotated[float, typer.Option(help="Give up (exit 1) after this many seconds.")] = 7
    * 24
    * 3600,
    poll: Annotated[float, typer.Option(min=0.1, help="Seconds between updates.")] = 1.0,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print a JSON object per change instead of a progress bar."),
    ] = False,
) -> None:
    """Follow a run: phase, step, tokens/s, ETA and restarts, until it finishes or pauses.
    Exit 0 when it succeeded, 1 when it failed, was cancelled or paused."""
    from cli.common import client
    from cli.watch import watch
    from client import ApiError

    try:
        with client() as api:
            state = watch(api, run_id, timeout=timeout, console=console, poll=poll, as_json=as_json)
    except ApiError as err:
        raise fail(f"{err.message} [{err.code}]", EXIT_API) from err
    except TimeoutError as err:
        raise fail(str(err), EXIT_FAILED) from err
    if state["status"] != "succeeded":
        if not as_json:
            why = f": {state['cause']}: {state['message']}" if state.get("cause") else ""
            err_console.print(f"run {run_id} {state['status']}{why}", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED)


@runs_app.command("eval")
def runs_eval(
    run_id: RunId,
    max_points: Annotated[
        int | None,
        typer.Option(min=1, help="Keep at most this many history points per eval set."),
    ] = None,
    by_phase: Annotated[
        bool,
        typer.Option(
            "--by-phase",
            help="Each eval set at each phase's end and its change over the phase "
            "(forgetting: a rise on a pretraining set after a supervised phase).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Evaluation per eval set (by name, with its task): baseline, latest and best perplexity,
    and the records scored and skipped, why and which (history with --json); --by-phase: a row
    per phase, a column per set."""
    if by_phase:
        from cli.evaluation import phase_matrix

        matrix = jsonable(call(lambda api: api.eval_by_phase(run_id)))
        if as_json:
            print_json(matrix)
        else:
            console.print(phase_matrix(matrix))
        return
    from cli.demo import eval_table, records_table, skipped_notes

    answer = call(lambda api: api.eval(run_id, max_points=max_points)).model_dump(mode="json")
    if as_json:
        print_json(answer)
    else:
        console.print(eval_table(answer))
        console.print(records_table(answer))
        for line in skipped_notes(answer):
            console.print(line, soft_wrap=True, markup=False, highlight=False)


@runs_app.command("ledger")
def runs_ledger(run_id: RunId, as_json: JsonOpt = False) -> None:
    """The token ledger: per phase and data source, the tokens planned against those trained
    so far, their target tokens and the epochs of each source; and the replay share trained
    against the plan's."""
    from cli.ledger import ledger_table

    answer = jsonable(call(lambda api: api.ledger(run_id)))
    if as_json:
        print_json(answer)
    else:
        console.print(ledger_table(answer))
