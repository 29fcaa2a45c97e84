"""`trainctl runs ledger`: the token ledger of a run (`GET /runs/{id}/ledger`) as a table
within 80 columns."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from cli.workflow import token_count


def _count(value: int | None) -> str:
    return "-" if value is None else token_count(value)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def ledger_table(ledger: dict[str, Any]) -> Table:
    """Per phase and source: tokens planned and trained so far, the source's share of its
    phase's tokens trained against the plan's (on a phase's row, the share that is replay),
    its target tokens and epochs; the caption says the run's replay share against the plan."""
    table = Table(
        title=f"{ledger['run_id']}: token ledger at step {ledger['step']}",
        box=None,
        pad_edge=False,
        caption_justify="left",
    )
    table.add_column("phase / source", overflow="fold", max_width=24)
    for column in ("planned", "trained", "share", "plan", "targets", "epochs"):
        table.add_column(column, justify="right", no_wrap=True)
    for phase in ledger["phases"]:
        role = " (replay)" if phase["role"] == "replay" else ""
        replay = phase["planned_replay_share"] or phase["replay_share"]
        table.add_row(
            f"[bold]{phase['name']}[/bold]{role}",
            _count(phase["planned_tokens"]),
            _count(phase["trained_tokens"]),
            _share(phase["replay_share"]) if replay else "",
            _share(phase["planned_replay_share"]) if replay else "",
            "",
            "",
        )
        for source in phase["sources"]:
            epochs = source["epochs"]
            table.add_row(
                f"  {source['name']}{'*' if source['replay'] else ''}",
                _count(source["planned_tokens"]),
                _count(source["trained_tokens"]),
                _share(source["trained_share"]),
                _share(source["planned_share"]),
                _count(source["target_tokens"]),
                "-" if epochs is None else f"{epochs:.2f}",
            )
    table.caption = _caption(ledger)
    return table


def _caption(ledger: dict[str, Any]) -> str:
    trained = ledger["trained_tokens"]
    if trained is None:
        counted = "not counted for every phase begun (a worker from before the ledger)"
    else:
        counted = (
            f"{ledger['replay_tokens']:,} of {trained:,} tokens trained, "
            f"{_share(ledger['replay_share'])} (plan {_share(ledger['planned_replay_share'])}); "
            f"of post-training tokens {_share(ledger['post_training_replay_share'])} "
            f"(plan {_share(ledger['planned_post_training_replay_share'])})"
        )
    return (
        f"replay (*): {counted}. share: a source's of its phase's tokens trained so far, "
        "against the plan's; on a phase's row, the share that is replay. tokens: the "
        "microbatch envelope, as planned; targets: those the loss was taken over"
    )
