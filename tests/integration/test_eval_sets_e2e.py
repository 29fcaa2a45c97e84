"""Named eval sets through the whole stack: two sets of one task, a real worker, the API and
the CLI. Before sets had names, results were keyed by (run, task, step) and the second set's
results overwrote the first's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from exact import workflow
from procs import DEMO, Stack, processes, run_cli, wait_for_run

pytestmark = pytest.mark.integration

DATA = DEMO.parent.parent / "data"


def test_two_eval_sets_of_one_task_keep_their_own_results_through_api_and_cli(
    tmp_path: Path, postgres_url: str
) -> None:
    doc = workflow("qa_reasoning", steps=4)
    [qa] = doc["evals"]
    doc["evals"] = [
        {**qa, "name": "qa-mixture", "data": str(DATA / "qa_reasoning.eval.jsonl")},
        {**qa, "name": "qa-rag", "data": str(DATA / "qa_rag.eval.jsonl")},
    ]
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": doc})
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=procs)
            assert run["status"] == "succeeded", run
            answer = api.get(f"/runs/{run['id']}/eval").json()
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        printed = json.loads(run_cli(["runs", "eval", run["id"], "--json"], env=env))
        table = run_cli(["runs", "eval", run["id"]], env=env)

    sets = answer["tasks"]
    assert sorted(sets) == ["qa-mixture", "qa-rag"]
    assert {s["task"] for s in sets.values()} == {"qa_reasoning"}
    mixture, rag = sets["qa-mixture"], sets["qa-rag"]
    assert [p["step"] for p in mixture["history"]] == [p["step"] for p in rag["history"]] == [0, 4]
    # Different files: different records and losses at every step, none overwritten.
    assert mixture["latest"]["records"] != rag["latest"]["records"] or (
        mixture["latest"]["target_tokens"] != rag["latest"]["target_tokens"]
    )
    for a, b in zip(mixture["history"], rag["history"], strict=True):
        assert math.isfinite(a["cross_entropy"]) and math.isfinite(b["cross_entropy"])
        assert a["cross_entropy"] != b["cross_entropy"]
    assert printed == answer
    assert "qa-mixture" in table and "qa-rag" in table and "qa_reasoning" in table


def test_a_qa_eval_file_with_an_unterminated_json_line_no_longer_fails_the_run(
    tmp_path: Path, postgres_url: str
) -> None:
    # The case: one held-out line cut short (and here one record of the wrong shape)
    # failed the run at step 0. Now both are skipped, counted by reason and named.
    lines = (DATA / "qa_reasoning.eval.jsonl").read_text().splitlines()
    lines[4] = lines[4][: len(lines[4]) // 2]  # unterminated JSON
    lines[9] = json.dumps({"text": "held-out text where question-answer pairs belong"})
    held_out = tmp_path / "qa.eval.jsonl"
    held_out.write_text("\n".join(lines) + "\n")
    doc = workflow("qa_reasoning", steps=4)
    [qa] = doc["evals"]
    doc["evals"] = [{**qa, "name": "qa-mixture", "data": str(held_out)}]
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": doc})
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=procs)
            assert run["status"] == "succeeded", run
            answer = api.get(f"/runs/{run['id']}/eval").json()
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        table = run_cli(["runs", "eval", run["id"]], env=env)

    mixture = answer["tasks"]["qa-mixture"]
    assert [p["step"] for p in mixture["history"]] == [0, 4]
    for point in mixture["history"]:
        assert point["records"] + point["oversized_records"] == len(lines) - 2
        assert point["skipped_records"] == {"malformed_json": 1, "wrong_shape": 1}
    examples = mixture["skipped_examples"]
    assert examples[0].startswith(f"{held_out}:5: not valid JSON")
    assert examples[1].startswith(f"{held_out}:10: a text record")
    # 2 of 48 skipped, more than SKIPPED_MARK_SHARE: the table marks the set and says why.
    assert "qa-mixture" in table and "2 !" in table
    assert "1 malformed JSON" in " ".join(table.split())
