"""What `trainctl runs watch` and `runs show` print of a run's state."""

from __future__ import annotations

from typing import Any

from cli.watch import _fields, preparing_text


def state(**changes: Any) -> dict[str, Any]:
    base = {
        "status": "running",
        "phase": "pretrain",
        "tokens_per_s": None,
        "restarts": 0,
        "preemptions": 0,
        "waiting_for_worker": False,
        "preparing": None,
    }
    return {**base, **changes}


def test_a_run_preparing_its_data_says_which_file_and_how_far() -> None:
    preparing = {"file": "/data/corpora/pretrain.jsonl", "fraction": 0.414}
    assert preparing_text(preparing) == "preparing: 41% of pretrain.jsonl"
    assert _fields(state(preparing=preparing))["status"] == (
        "running (preparing: 41% of pretrain.jsonl)"
    )
    assert _fields(state())["status"] == "running"
