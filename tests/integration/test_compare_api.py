"""Comparing runs, their tags and notes, filters and CSV exports, against a live `trainctl
serve` (Postgres, Redis; no worker: the runs report through the worker protocol) with two runs
that differ in one data file and one learning rate: the API, then the CLI as a user types it."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from compare_support import (
    EVAL_SETS,
    FIRST_LR,
    SECOND_LR,
    differing_pair,
    loss_of,
    perplexity_of,
    report_first_phase,
    train,
)
from procs import Stack, cli, processes, run_cli

pytestmark = pytest.mark.integration

EXIT_BAD_INPUT, EXIT_API = 2, 3
STEPS = 10  # reported of each run's first phase


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code, body
    return dict(body["error"])


def expected_differences(pair: Any) -> dict[str, list[Any]]:
    return {
        "optimizer.adamw_lr": [FIRST_LR, SECOND_LR],
        f'data["{pair.data_path}"].sha256': [pair.sha_before, pair.sha_after],
    }


def test_compare_names_the_data_file_and_learning_rate_and_tables_the_eval_sets(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        api = stack.api()
        pair = differing_pair(api, tmp_path)
        first, second = pair.ids
        assert pair.sha_before != pair.sha_after
        reporters = [
            report_first_phase(stack.url, stack.worker_token, run, i, until=STEPS)
            for i, run in enumerate((pair.first, pair.second))
        ]

        answer = api.get("/runs/compare", params={"ids": f"{first},{second}"})
        assert answer.status_code == 200, answer.text
        comparison = answer.json()
        assert [r["id"] for r in comparison["runs"]] == [first, second]
        assert [r["name"] for r in comparison["runs"]] == ["baseline-lr", "lower-lr"]
        assert [p["name"] for p in comparison["runs"][0]["phases"]] == [
            p["name"] for p in pair.first["plan"]["phases"]
        ]
        inputs = comparison["inputs"]
        assert inputs["identical"] is False and inputs["same_signature"] is False
        assert {d["field"]: d["values"] for d in inputs["differences"]} == expected_differences(
            pair
        )
        assert "2 input field(s) differ" in inputs["summary"]

        # The eval table: every set, each run's baseline, final and best, changes vs the first.
        assert [s["name"] for s in comparison["evals"]] == sorted(EVAL_SETS)
        for eval_set in comparison["evals"]:
            name = eval_set["name"]
            a, b = eval_set["runs"]
            assert (a["run_id"], b["run_id"]) == (first, second)
            for i, row in enumerate((a, b)):
                assert row["baseline"]["step"] == 0
                assert row["baseline"]["perplexity"] == pytest.approx(perplexity_of(i, name, 0))
                assert row["final"]["step"] == STEPS
                assert row["final"]["perplexity"] == pytest.approx(perplexity_of(i, name, STEPS))
                assert row["best"]["step"] == STEPS  # perplexity falls at every evaluation
            assert a["final_vs_first"] is None
            assert b["final_vs_first"] == pytest.approx(
                100 * (perplexity_of(1, name, STEPS) / perplexity_of(0, name, STEPS) - 1)
            )
            assert a["final_vs_baseline"] == pytest.approx(
                100 * (perplexity_of(0, name, STEPS) / perplexity_of(0, name, 0) - 1)
            )

        # A live run keeps moving: a later evaluation is the new final.
        reporters[1].evals(1, 15, pair.second["plan"]["phases"][0]["name"])
        later = api.get("/runs/compare", params={"ids": f"{first},{second}"}).json()
        assert later["evals"][0]["runs"][1]["final"]["step"] == 15

        # Identical inputs say so: a third run of the second's workflow, on the same file.
        again = api.post("/runs", json={"workflow_id": pair.second["workflow_id"], "name": "again"})
        assert again.status_code == 201, again.text
        third = again.json()
        same = api.get("/runs/compare", params={"ids": f"{second},{third['id']}"}).json()
        assert same["inputs"]["identical"] is True and same["inputs"]["same_signature"] is True
        assert same["inputs"]["differences"] == []
        assert same["inputs"]["summary"].startswith("identical inputs")
        # ... and a third run's column is there for every set, empty without evaluations.
        three = api.get("/runs/compare", params={"ids": f"{first},{second},{third['id']}"}).json()
        assert [r["final"] for r in three["evals"][0]["runs"]][2] is None
        assert {d["field"]: d["values"][2] for d in three["inputs"]["differences"]} == {
            "optimizer.adamw_lr": SECOND_LR,
            f'data["{pair.data_path}"].sha256': pair.sha_after,
        }

        # Refusals, in the error shape.
        assert_error(api.get("/runs/compare", params={"ids": first}), 422, "invalid_request")
        assert_error(
            api.get("/runs/compare", params={"ids": f"{first},{first}"}), 422, "invalid_request"
        )
        assert_error(
            api.get("/runs/compare", params={"ids": ",".join([first] * 9)}), 422, "invalid_request"
        )
        missing = assert_error(
            api.get("/runs/compare", params={"ids": f"{first},run_doesnotexist"}),
            404,
            "run_not_found",
        )
        assert "run_doesnotexist" in missing["message"]
        # A user token sees only its own runs: another owner's is 404, as on every route.
        user = httpx.Client(
            base_url=stack.url, headers={"Authorization": f"Bearer {stack.token('user')}"}
        )
        assert_error(
            user.get("/runs/compare", params={"ids": f"{first},{second}"}), 404, "run_not_found"
        )
        assert_error(user.patch(f"/runs/{first}", json={"note": "mine"}), 404, "run_not_found")
        viewer = httpx.Client(
            base_url=stack.url, headers={"Authorization": f"Bearer {stack.token('viewer')}"}
        )
        assert viewer.get("/runs/compare", params={"ids": f"{first},{second}"}).status_code == 200
        assert_error(viewer.patch(f"/runs/{first}", json={"note": "x"}), 403, "forbidden")
        for client in (user, viewer, *(r.client for r in reporters)):
            client.close()
        api.close()


def test_tags_notes_filters_and_csv_exports(tmp_path: Path, postgres_url: str) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        api = stack.api()
        pair = differing_pair(api, tmp_path)
        first, second = pair.ids
        reporter = report_first_phase(stack.url, stack.worker_token, pair.first, 0, until=STEPS)

        # PATCH: name, tags (the whole set, sorted, once each) and note; a field left out stays.
        patched = api.patch(
            f"/runs/{first}",
            json={"name": "lr 3e-3", "tags": ["sweep", "baseline", "sweep"], "note": "why: ref"},
        )
        assert patched.status_code == 200, patched.text
        run = patched.json()
        assert (run["name"], run["tags"], run["note"]) == (
            "lr 3e-3",
            ["baseline", "sweep"],
            "why: ref",
        )
        assert api.patch(f"/runs/{second}", json={"tags": ["sweep"]}).json()["tags"] == ["sweep"]
        kept = api.patch(f"/runs/{first}", json={"tags": ["baseline", "sweep", "kept"]}).json()
        assert (kept["name"], kept["note"]) == ("lr 3e-3", "why: ref")
        shown = api.get(f"/runs/{first}").json()
        assert (shown["tags"], shown["note"]) == (["baseline", "kept", "sweep"], "why: ref")
        cleared = api.patch(f"/runs/{first}", json={"tags": ["baseline", "sweep"], "note": None})
        assert cleared.json()["note"] is None
        bad = assert_error(
            api.patch(f"/runs/{first}", json={"tags": ["two words"]}), 422, "invalid_request"
        )
        assert bad["details"][0]["path"] == "tags[0]"
        assert_error(
            api.patch(f"/runs/{first}", json={"status": "succeeded"}), 422, "invalid_request"
        )
        events = api.get("/audit", params={"action": "run.update", "target_id": first}).json()
        assert [e["details"]["fields"] for e in reversed(events["events"])] == [
            ["name", "note", "tags"],
            ["tags"],
            ["note", "tags"],
        ]

        # Filters: tag (every one given), name (any case), status; cursor pages keep them.
        def ids(**params: Any) -> list[str]:
            answer = api.get("/runs", params=params)
            assert answer.status_code == 200, answer.text
            return [r["id"] for r in answer.json()["runs"]]

        assert ids(tag="sweep") == [second, first]
        assert ids(tag=["sweep", "baseline"]) == [first]
        assert ids(tag="nothing") == []
        assert ids(name="LOWER") == [second]
        assert ids(name="3e-3", tag="sweep") == [first]
        assert ids(name="%") == [] and ids(name="_") == []  # taken literally
        assert ids(status="running") == [first]
        assert set(ids(status="queued")) == {second}
        page = api.get("/runs", params={"tag": "sweep", "limit": 1}).json()
        assert ([r["id"] for r in page["runs"]], page["count"]) == ([second], 2)
        rest = api.get(
            "/runs", params={"tag": "sweep", "limit": 1, "cursor": page["next_cursor"]}
        ).json()
        assert ([r["id"] for r in rest["runs"]], rest["next_cursor"]) == ([first], None)

        # CSV: every point, long form, in (name, step) order; thinned with max_points.
        answer = api.get(f"/runs/{first}/metrics.csv")
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("text/csv")
        assert f"{first}-metrics.csv" in answer.headers["content-disposition"]
        rows = list(csv.DictReader(io.StringIO(answer.text)))
        assert list(rows[0]) == ["run_id", "name", "step", "value"]
        assert [(r["name"], int(r["step"])) for r in rows] == [
            (name, step) for name in ("loss", "lr") for step in range(1, STEPS + 1)
        ]
        loss = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "loss"}
        assert loss == {step: loss_of(0, step) for step in range(1, STEPS + 1)}  # exact
        thinned = api.get(f"/runs/{first}/metrics.csv", params={"names": "loss", "max_points": 4})
        steps = [int(r["step"]) for r in csv.DictReader(io.StringIO(thinned.text))]
        assert 2 <= len(steps) <= 4 and steps[0] == 1 and steps[-1] == STEPS
        assert api.get(f"/runs/{second}/metrics.csv").text.strip() == ("run_id,name,step,value")
        evals = api.get(f"/runs/{first}/eval.csv")
        assert evals.headers["content-type"].startswith("text/csv")
        eval_rows = list(csv.DictReader(io.StringIO(evals.text)))
        assert list(eval_rows[0]) == [
            "run_id", "name", "task", "step", "phase", "cross_entropy", "perplexity",
            "records", "target_tokens", "oversized_records", "skipped_malformed_json",
            "skipped_wrong_shape", "skipped_no_target",
        ]  # fmt: skip
        assert len(eval_rows) == len(EVAL_SETS) * 3  # steps 0, 5 and 10
        # The JSON forms answer JSON only; a CSV of a run that does not exist is a 404.
        for path in (f"/runs/{first}/metrics", f"/runs/{first}/eval"):
            assert api.get(path).headers["content-type"] == "application/json", path
        assert_error(api.get("/runs/run_nope/metrics.csv"), 404, "run_not_found")
        reporter.close()
        api.close()


def test_cli_compares_exports_updates_and_filters(tmp_path: Path, postgres_url: str) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        env = {
            **stack.env,
            "TRAINCTL_API_URL": stack.url,
            "TRAINCTL_TOKEN": stack.admin,
            "COLUMNS": "250",
        }
        api = stack.api()
        pair = differing_pair(api, tmp_path)
        first, second = pair.ids
        reporters = [
            report_first_phase(stack.url, stack.worker_token, run, i, until=STEPS)
            for i, run in enumerate((pair.first, pair.second))
        ]

        printed = run_cli(["runs", "compare", first, second], env=env)
        assert "optimizer.adamw_lr" in printed and "0.003" in printed and "0.001" in printed
        assert pair.sha_before in printed and pair.sha_after in printed
        assert "2 input field(s) differ" in printed
        for name in EVAL_SETS:
            assert name in printed
        as_json = json.loads(run_cli(["runs", "compare", first, second, "--json"], env=env))
        assert as_json == api.get("/runs/compare", params={"ids": f"{first},{second}"}).json()
        lonely = cli(["runs", "compare", first], env=env)
        assert lonely.returncode == EXIT_BAD_INPUT, lonely.stderr
        missing = cli(["runs", "compare", first, "run_doesnotexist"], env=env)
        assert missing.returncode == EXIT_API and "run_doesnotexist" in missing.stderr

        # Export: two CSV files with their documented columns.
        out = tmp_path / "export"
        said = run_cli(["runs", "export", first, str(out)], env=env)
        assert f"metrics: {out / 'metrics.csv'} ({2 * STEPS} rows)" in said
        assert f"evals: {out / 'evals.csv'} ({3 * len(EVAL_SETS)} rows)" in said
        metrics = (out / "metrics.csv").read_text().splitlines()
        assert metrics[0] == "run_id,name,step,value" and len(metrics) == 1 + 2 * STEPS
        assert (out / "evals.csv").read_text().splitlines()[0].startswith("run_id,name,task,step,")
        assert sorted(p.name for p in out.iterdir()) == ["evals.csv", "metrics.csv"]
        gone = cli(["runs", "export", "run_doesnotexist", str(tmp_path / "nothing")], env=env)
        assert gone.returncode == EXIT_API and "run_doesnotexist" in gone.stderr
        assert not (tmp_path / "nothing" / "metrics.csv").exists()

        # Tags and notes, and the filters of runs list.
        updated = run_cli(
            ["runs", "update", first, "--tag", "baseline", "--tag", "sweep", "--note", "ref"],
            env=env,
        )
        assert "baseline, sweep" in updated and "note: ref" in updated
        run_cli(["runs", "update", second, "--tag", "sweep", "--name", "lr 1e-3"], env=env)
        listed = json.loads(run_cli(["runs", "list", "--tag", "sweep", "--json"], env=env))
        assert [r["id"] for r in listed["runs"]] == [second, first]
        only = json.loads(
            run_cli(["runs", "list", "--tag", "sweep", "--tag", "baseline", "--json"], env=env)
        )
        assert [r["id"] for r in only["runs"]] == [first]
        named = json.loads(run_cli(["runs", "list", "--name", "1E-3", "--json"], env=env))
        assert [r["id"] for r in named["runs"]] == [second]
        running = json.loads(run_cli(["runs", "list", "--status", "running", "--json"], env=env))
        assert {r["id"] for r in running["runs"]} == {first, second}
        table = run_cli(["runs", "list", "--tag", "baseline"], env=env)
        assert first in table and second not in table and "baseline, sweep" in table
        shown = run_cli(["runs", "show", first], env=env)
        assert "tags: baseline, sweep" in shown and "note: ref" in shown
        cleared = json.loads(run_cli(["runs", "update", first, "--clear-tags", "--json"], env=env))
        assert cleared["tags"] == [] and cleared["note"] == "ref"
        nothing = cli(["runs", "update", first], env=env)
        assert nothing.returncode == EXIT_BAD_INPUT
        for reporter in reporters:
            reporter.close()
        api.close()


def whole_numbers_within(printed: str, numbers: list[str], width: int = 80) -> None:
    lines = printed.splitlines()
    assert max(len(line) for line in lines) <= width, printed
    for value in numbers:
        assert re.search(rf"(^|\s){re.escape(value)}(\s|\*|$)", printed, re.M), (value, printed)


def test_the_cli_prints_evals_by_phase_runs_and_comparisons_whole_at_80_columns(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        env = {
            **stack.env,
            "TRAINCTL_API_URL": stack.url,
            "TRAINCTL_TOKEN": stack.admin,
            "COLUMNS": "80",
        }
        api = stack.api()
        pair = differing_pair(api, tmp_path, pretrain_steps=10, sft_steps=10)
        first, second = pair.ids
        train(api, stack.worker_token, pair.first, 0, until=30).close()
        running = train(api, stack.worker_token, pair.second, 1, until=17)
        for run_id, name in (
            (first, "replay phases, reset at every phase (reference)"),
            (second, "mixture replay with a lower learning rate"),
        ):
            assert api.patch(f"/runs/{run_id}", json={"name": name}).status_code == 200

        # By phase: each set at each phase's end (10, 20, 30) and its change over the phase.
        matrix = api.get(f"/runs/{first}/eval/phases").json()
        assert [p["last_step"] for p in matrix["phases"]] == [10, 20, 30]
        printed = run_cli(["runs", "eval", first, "--by-phase"], env=env)
        ends = [perplexity_of(0, name, step) for name in EVAL_SETS for step in (10, 20, 30)]
        whole_numbers_within(printed, [f"{value:.2f}" for value in ends])
        for phase in pair.first["plan"]["phases"]:  # a long name may be shortened, not dropped
            assert phase["name"][:12] in printed
        by_json = json.loads(run_cli(["runs", "eval", first, "--by-phase", "--json"], env=env))
        assert by_json == matrix
        # The running run's phase shows its latest evaluation so far, marked.
        so_far = run_cli(["runs", "eval", second, "--by-phase"], env=env)
        whole_numbers_within(so_far, [f"{perplexity_of(1, 'summarization', 15):.2f}"])
        assert "* so far" in so_far

        printed = run_cli(["runs", "eval", first], env=env)
        whole_numbers_within(
            printed,
            [f"{perplexity_of(0, name, 30):.2f} @30" for name in EVAL_SETS]
            + [f"{perplexity_of(0, name, 0):.2f}" for name in EVAL_SETS],
        )
        listed = run_cli(["runs", "list"], env=env)
        whole_numbers_within(listed, [first, second, "30/30", "17/30"])

        compared = run_cli(["runs", "compare", first, second], env=env)
        whole_numbers_within(
            compared,
            [f"{perplexity_of(0, name, 30):.2f} @30" for name in EVAL_SETS]
            + [f"{perplexity_of(1, name, 15):.2f} @15" for name in EVAL_SETS],
        )
        # The eval table first, then the runs, then what differs by group.
        assert compared.index("evaluation per eval set") < compared.index("runs (the first")
        assert compared.index("runs (the first") < compared.index("what differs")
        assert "data files: 1 changed" in compared and "optimizer: 1 field" in compared
        assert compared.index("data files:") < compared.index("optimizer:")
        running.close()
        api.close()
