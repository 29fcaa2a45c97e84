"""The token ledger and best checkpoints on the run page, in real headless Chromium against a
live `trainctl serve`, the worker's side reported over HTTP.

Screenshots kept in tests/e2e/artifacts/: ledger-run-page.png (a finished run with a replay
source: its token ledger, best checkpoint per eval set) and ledger-table.png (the ledger card
alone), and initial-best-run-page.png (a run started from that run's best checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import LiveStack, ReportingWorker, eval_results, live_stack, metric_points
from exact import make_initial_checkpoint
from procs import short_demo_workflow
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from test_dashboard import assert_no_console_errors, open_run, wait_for

pytestmark = pytest.mark.integration

# Phase 1 (summarization, steps 11-20) deals every fourth microbatch to replayed pretraining
# text (3 of 10, where the plan says 2: a worker's dealing stays within a few microbatches of
# its plan); one microbatch a step, 512 tokens.
REPLAY_EVERY = 4
ENVELOPE = 512


def replaying_workflow() -> dict[str, Any]:
    doc = short_demo_workflow(pretrain_steps=10, sft_steps=10)
    pretrain, summarize, _ = doc["phases"]
    summarize["data"] = [
        *summarize["data"],
        {
            "name": "replay",
            "path": pretrain["data"][0]["path"],
            "weight": 0.25,
            "objective": "continued_pretrain",
            "sequence_length": 128,
            "microbatch_size": 4,
        },
    ]
    doc["checkpoint"] = {"every_steps": 5, "keep_last": 2, "keep_best": ["summarization"]}
    return doc


def ledger_points(phase: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """What worker.train.ledger reports at `step`: each source's counts so far in its phase."""
    names = [s["name"] for s in phase["sources"]]
    done = range(phase["first_step"], step + 1)
    if len(names) == 1:
        counts = {names[0]: len(done)}
    else:
        replayed = sum(1 for s in done if s % REPLAY_EVERY == 0)
        counts = {names[0]: len(done) - replayed, "replay": replayed}
    points = []
    for name, microbatches in counts.items():
        tokens = microbatches * ENVELOPE
        targets = tokens if name in ("pretrain", "replay") else tokens * 3 // 10
        points += [
            {"name": f"tokens/{name}", "step": step, "value": tokens},
            {"name": f"target_tokens/{name}", "step": step, "value": targets},
            {"name": f"epochs/{name}", "step": step, "value": tokens / 40_000},
        ]
    return points


def report(
    worker: ReportingWorker, phase: dict[str, Any], index: int, first: int, last: int
) -> None:
    """Steps first..last of a phase as a worker reports them, the ledger's series with the
    rest; evaluations and a checkpoint every 5 steps and at the phase's end."""
    if first == 1:
        worker.evals(eval_results(0, phase["name"]))
    worker.metrics(
        [
            p
            for step in range(first, last + 1)
            for p in [*metric_points(step, phase), *ledger_points(phase, step)]
        ]
    )
    for step in range(first, last + 1):
        if step % 5 == 0 or step == phase["last_step"]:
            worker.evals(eval_results(step, phase["name"]))
            worker.checkpoint(step, index, step - phase["first_step"] + 1)
    worker.heartbeat(last)


def submit(live: LiveStack) -> dict[str, Any]:
    created = live.api.post("/runs", json={"workflow": replaying_workflow(), "name": "ledger"})
    assert created.status_code == 201, created.text
    return dict(created.json())


def finished_replaying_run(live: LiveStack) -> dict[str, Any]:
    """A run of three phases trained to its end, with the ledger's series reported."""
    run = submit(live)
    for index, phase in enumerate(run["plan"]["phases"]):
        worker, _ = live.claim_next(run["id"])
        report(worker, phase, index, phase["first_step"], phase["last_step"])
        worker.finish("succeeded", phase["last_step"])
    return live.run(run["id"])


def test_the_run_page_shows_the_token_ledger_and_the_best_checkpoints(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run = finished_replaying_run(live)
        assert run["status"] == "succeeded"
        open_run(browser, live, run["id"])
        wait_for(
            browser,
            "document.querySelectorAll('#ledger-table tbody tr').length === 7",
            "the ledger shows three phases and their four sources",
        )
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#ledger-table tbody tr')]"
            ".map((r) => [...r.cells].map((c) => c.textContent));"
        )
        assert rows[0] == ["pretrain", "5,120", "5,120", "", "", "", ""]
        assert rows[1] == ["pretrain", "5,120", "5,120", "100.0%", "100.0%", "5,120", "0.13"]
        # The mixture: summarization 7 microbatches, replay 3 (steps 12, 16 and 20), against a
        # plan of 4:1 of 5,120 tokens: the phase's replay share 30.0% against 20.0%.
        assert rows[2] == ["sft_summarization", "5,120", "5,120", "30.0%", "20.0%", "", ""]
        assert rows[3][:5] == ["summarization", "4,096", "3,584", "70.0%", "80.0%"]
        assert rows[4] == ["replayreplay", "1,024", "1,536", "30.0%", "20.0%", "1,536", "0.04"]
        summary = browser.find_element(By.ID, "ledger-summary").text
        assert summary.startswith("Replay: 1,536 of 15,360 tokens trained, 10.0% (plan 6.7%)")

        # Best checkpoint per eval set: summarization's kept (checkpoint.keep_best).
        best = browser.execute_script(
            "return [...document.querySelectorAll('#best-checkpoints li')]"
            ".map((li) => [li.dataset.set, li.dataset.step, li.textContent]);"
        )
        assert ["summarization", "30", "summarization: step 30kept"] in best
        browser.save_screenshot(str(artifacts / "ledger-run-page.png"))
        card = browser.find_element(By.ID, "ledger-card")
        browser.execute_script("arguments[0].scrollIntoView();", card)
        card.screenshot(str(artifacts / "ledger-table.png"))
        assert_no_console_errors(browser)

        # A run started from that best checkpoint says so among its facts (the service checks
        # its weights: the demo model's, written where the worker would have).
        doc = replaying_workflow()
        checkpoint = Path(
            live.api.get(f"/runs/{run['id']}/checkpoints").json()["checkpoints"][-1]["path"]
        )
        make_initial_checkpoint(checkpoint, doc["model"]["config"])
        body = {
            "workflow": doc,
            "initial_checkpoint": {"run": run["id"], "best": "summarization"},
        }
        created = live.api.post("/runs", json=body)
        assert created.status_code == 201, created.text
        driver_run = created.json()["id"]
        browser.get(f"{live.url}/#/runs/{driver_run}")
        wait_for(
            browser,
            "[...document.querySelectorAll('#run-facts dd')].some((d) => "
            f"d.textContent === 'run {run['id']}, step 30 (best of summarization)')",
            "the initial checkpoint fact names the run, step and set",
        )
        browser.save_screenshot(str(artifacts / "initial-best-run-page.png"))
        assert_no_console_errors(browser)


def test_the_ledger_follows_a_running_run(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run = submit(live)
        pretrain = run["plan"]["phases"][0]
        worker, _ = live.claim_next(run["id"])
        report(worker, pretrain, 0, 1, 4)
        open_run(browser, live, run["id"])
        wait_for(browser, "window.trainctl.page.live === 'live'", "the page follows the events")
        trained = "document.querySelector('#ledger-table tbody tr:nth-child(2) td:nth-child(3)')"
        wait_for(browser, f"{trained} && {trained}.textContent === '2,048'", "4 steps trained")
        # Phase 2 has not begun: nothing trained, known as such.
        assert (
            browser.execute_script(
                "return document.querySelector('#ledger-table tr[data-source=retrieval_planning] "
                "td:nth-child(3)').textContent;"
            )
            == "0"
        )
        report(worker, pretrain, 0, 5, 7)
        wait_for(browser, f"{trained}.textContent === '3,584'", "the ledger reads 7 steps")
        assert_no_console_errors(browser)
