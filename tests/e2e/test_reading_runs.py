"""Reading a run and a comparison in the dashboard, in real headless Chromium against a live
`trainctl serve`: forgetting phase by phase (a phases x sets matrix coloured by change), the
perplexity charts on a log scale, the training loss by data source (replay text against
supervised data), and a comparison whose differences come grouped, a long group folded.

Screenshots are kept in tests/e2e/artifacts/: forgetting-matrix.png, eval-charts-log.png,
loss-by-source.png, forgetting-run-page.png, compare-folded.png (a long group folded) and
compare-grouped.png (opened).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
from e2e_support import LiveStack, ReportingWorker, live_stack
from procs import short_demo_workflow
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = pytest.mark.integration

WAIT_SECONDS = 20
MINUS = "\u2212"
# Phases: pretrain 1-30 (its own text), sft_summarization 31-45 (summaries with a quarter of
# replayed pretraining text), sft_planning 46-60 (planning records).
PRETRAIN_STEPS, SFT_STEPS = 30, 15
BOUNDS = (0, 30, 45, 60)
# Each eval set's perplexity at the baseline and at each phase's end; between them it moves
# geometrically. The pretraining set is forgotten in both supervised phases.
ANCHORS = {
    "continued_pretrain": (480.0, 4.0, 6.0, 7.5),
    "summarization": (350.0, 40.0, 5.0, 6.0),
    "retrieval_planning": (300.0, 50.0, 45.0, 8.0),
}


def perplexity(name: str, step: int) -> float:
    anchors = ANCHORS[name]
    for i in range(len(BOUNDS) - 1):
        a, b = BOUNDS[i], BOUNDS[i + 1]
        if a <= step <= b:
            t = (step - a) / (b - a)
            return anchors[i] * (anchors[i + 1] / anchors[i]) ** t
    raise ValueError(step)


def loss(step: int, source: str) -> float:
    base = {"pretrain": 2.0, "summarization": 3.0, "retrieval_planning": 3.5}[source]
    return base + 3.0 * math.exp(-step / 15)


def wait_for(driver: WebDriver, script: str, what: str) -> Any:
    try:
        return WebDriverWait(driver, WAIT_SECONDS, poll_frequency=0.2).until(
            lambda d: d.execute_script(f"return ({script});")
        )
    except Exception as err:
        raise AssertionError(
            f"{what}: `{script}` stayed false for {WAIT_SECONDS} s\n{driver.get_log('browser')}"
        ) from err


def assert_no_console_errors(driver: WebDriver) -> None:
    errors = [m for m in driver.get_log("browser") if m["level"] in ("SEVERE", "ERROR")]
    assert not errors, f"console errors: {errors}"


def sign_in(driver: WebDriver, live: LiveStack) -> None:
    driver.get(live.url + "/")
    wait_for(driver, "!document.querySelector('#token-view').hidden", "the token form shows")
    driver.find_element(By.ID, "token-input").send_keys(live.admin_token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    wait_for(driver, "!document.querySelector('#runs-view').hidden", "the runs table shows")


def mixture_workflow() -> dict[str, Any]:
    """The demo cut to three phases, the supervised summarization phase replaying a quarter
    of pretraining text (at the pretraining geometry, the same 512-token envelope), and three
    eval sets."""
    doc = short_demo_workflow(pretrain_steps=PRETRAIN_STEPS, sft_steps=SFT_STEPS)
    pretrain = doc["phases"][0]["data"][0]["path"]
    doc["phases"][1]["data"].append(
        {
            "path": pretrain,
            "weight": 1 / 3,
            "objective": "continued_pretrain",
            "sequence_length": 128,
            "microbatch_size": 4,
        }
    )
    doc["evals"] = [e for e in doc["evals"] if e["task"] in ANCHORS]
    return doc


def evals(step: int, phase: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "task": name,
            "step": step,
            "phase": phase,
            "cross_entropy": math.log(perplexity(name, step)),
            "perplexity": perplexity(name, step),
            "records": 8,
            "target_tokens": 160,
            "oversized_records": 0,
        }
        for name in ANCHORS
    ]


def report(
    worker: ReportingWorker, phase: dict[str, Any], index: int, first: int, last: int
) -> None:
    """Steps first..last of a phase: the loss at every step, each source's in the mixture,
    evaluations every 5 steps (and the baseline), a checkpoint at the phase's end."""
    sources = [s["name"] for s in phase["sources"]]
    points = []
    for step in range(first, last + 1):
        shares = {name: 1.0 / len(sources) for name in sources}
        points.append(
            {"name": "loss", "step": step, "value": sum(loss(step, n) * shares[n] for n in sources)}
        )
        if len(sources) > 1:
            points += [{"name": f"loss/{n}", "step": step, "value": loss(step, n)} for n in sources]
        points.append({"name": "lr", "step": step, "value": 1e-3})
    worker.metrics(points)
    if first == 1:
        worker.evals(evals(0, phase["name"]))
    for step in range(first, last + 1):
        if step % 5 == 0:
            worker.evals(evals(step, phase["name"]))
    if last == phase["last_step"]:
        worker.checkpoint(last, index, last - phase["first_step"] + 1)
    worker.heartbeat(last)


def test_run_page_shows_forgetting_by_phase_log_scale_perplexity_and_loss_by_source(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        created = live.api.post("/runs", json={"workflow": mixture_workflow(), "name": "mix"})
        assert created.status_code == 201, created.text
        run = created.json()
        phases = run["plan"]["phases"]
        assert [[s["name"] for s in p["sources"]] for p in phases] == [
            ["pretrain"],
            ["summarization", "pretrain"],
            ["retrieval_planning"],
        ]
        for index in (0, 1):
            worker, _ = live.claim_next(run["id"])
            report(
                worker,
                phases[index],
                index,
                phases[index]["first_step"],
                phases[index]["last_step"],
            )
            worker.finish("succeeded", phases[index]["last_step"])
        last, _ = live.claim_next(run["id"])
        report(last, phases[2], 2, 46, 52)  # the planning phase trains: evaluated at 50 so far

        sign_in(browser, live)
        browser.get(f"{live.url}/#/runs/{run['id']}")
        wait_for(
            browser,
            "window.trainctl.page && window.trainctl.page.plots !== null && "
            "!document.querySelector('#phase-card').hidden",
            "the run page draws the forgetting matrix",
        )

        # The matrix: a row per phase after the baseline, a column per set, coloured by change.
        cells = browser.execute_script(
            "return Object.fromEntries([...document.querySelectorAll('#phase-matrix td[data-set]')]"
            ".map((td) => [`${td.closest('tr').dataset.phase}|${td.dataset.set}`,"
            "[td.textContent, td.dataset.change || null, td.dataset.complete || null,"
            " getComputedStyle(td).backgroundColor]]));"
        )
        assert cells["|continued_pretrain"][0] == "480"  # the baseline row
        text, change, complete, color = cells["pretrain|continued_pretrain"]
        assert (text, change, complete) == (f"4{MINUS}99%", "better", "true")
        assert color.startswith("rgba(15, 123, 95")  # green
        # The supervised phase forgets pretraining: +50%, red.
        text, change, complete, color = cells["sft_summarization|continued_pretrain"]
        assert (text, change, complete) == ("6+50%", "worse", "true")
        assert color.startswith("rgba(180, 35, 24")
        assert cells["sft_summarization|summarization"][:2] == [f"5{MINUS}88%", "better"]
        # The phase in training: its latest evaluation (step 50), marked, not its end.
        so_far = perplexity("retrieval_planning", 50)
        expected = f"{so_far:.4g}*{MINUS}{100 * (1 - so_far / 45):.0f}%"
        assert cells["sft_planning|retrieval_planning"][0] == expected
        assert cells["sft_planning|retrieval_planning"][2] == "false"
        card = browser.find_element(By.ID, "phase-card")
        card.screenshot(str(artifacts / "forgetting-matrix.png"))

        # Perplexity on a log scale: the baseline ~480 and the trained 4-8 both readable.
        scales = browser.execute_script(
            "return Object.values(window.trainctl.page.plots.evals).map((p) => p.scales.y.distr);"
        )
        assert scales == [3, 3, 3]
        pretrain_chart = browser.execute_script(
            "return window.trainctl.page.plots.evals['continued_pretrain'].data;"
        )
        assert pretrain_chart[1][0] == pytest.approx(480.0)
        assert pretrain_chart[1][pretrain_chart[0].index(30)] == pytest.approx(4.0)
        browser.find_element(By.ID, "eval-charts").screenshot(
            str(artifacts / "eval-charts-log.png")
        )

        # Loss by source: pretraining text alone (1-30) and replayed in the mixture (31-45);
        # the summaries in the mixture; the planning records alone (46-52).
        assert browser.find_element(By.ID, "source-loss-card").is_displayed()
        steps, pretrain, summaries, planning = browser.execute_script(
            "return window.trainctl.page.plots.sources.data;"
        )
        assert steps == list(range(1, 53))
        assert pretrain[:45] == [pytest.approx(loss(s, "pretrain")) for s in range(1, 46)]
        assert all(v is None for v in pretrain[45:])
        assert all(v is None for v in summaries[:30]) and all(v is None for v in summaries[45:])
        assert summaries[30:45] == [pytest.approx(loss(s, "summarization")) for s in range(31, 46)]
        assert planning[45:] == [
            pytest.approx(loss(s, "retrieval_planning")) for s in range(46, 53)
        ]
        labels = browser.execute_script(
            "return window.trainctl.page.plots.sources.series.slice(1).map((s) => s.label);"
        )
        assert labels == ["pretrain", "summarization", "retrieval_planning"]
        browser.find_element(By.ID, "source-loss-card").screenshot(
            str(artifacts / "loss-by-source.png")
        )
        assert_no_console_errors(browser)

        # Live: the last phase ends, and its row becomes its end, without a reload.
        report(last, phases[2], 2, 53, 60)
        last.finish("succeeded", 60)
        wait_for(
            browser,
            "document.querySelector(\"#phase-matrix tr[data-phase='sft_planning'] "
            "td[data-set='retrieval_planning']\").dataset.complete === 'true'",
            "the matrix follows the run to its last evaluation",
        )
        wait_for(
            browser,
            "window.trainctl.page.plots.sources.data[0].length === 60",
            "the source chart follows the new steps",
        )
        finished = browser.execute_script(
            "return document.querySelector(\"#phase-matrix tr[data-phase='sft_planning'] "
            "td[data-set='retrieval_planning']\").textContent;"
        )
        assert finished == f"8{MINUS}82%"
        browser.save_screenshot(str(artifacts / "forgetting-run-page.png"))
        assert_no_console_errors(browser)


def test_compare_view_shows_evals_first_and_folds_a_long_group_of_differences(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        first_doc = short_demo_workflow(pretrain_steps=PRETRAIN_STEPS, sft_steps=SFT_STEPS)
        second_doc = copy.deepcopy(first_doc)
        for phase in second_doc["phases"]:  # six per-phase fields: folded
            phase["lr_scale"] = 0.5
            phase["schedule"]["warmup_steps"] = 3
        second_doc["optimizer"]["adamw_lr"] = 1e-3
        mixture = mixture_workflow()
        second_doc["phases"][1]["data"] = mixture["phases"][1]["data"]
        ids = []
        for name, doc in (("reference", first_doc), ("sweep", second_doc)):
            created = live.api.post("/runs", json={"workflow": doc, "name": name})
            assert created.status_code == 201, created.text
            ids.append(created.json()["id"])
        for run_id in ids:
            worker, _ = live.claim_next(run_id)
            run = live.run(run_id)
            worker.evals(evals(0, run["plan"]["phases"][0]["name"]))
            worker.evals(evals(10, run["plan"]["phases"][0]["name"]))
            worker.heartbeat(10)

        sign_in(browser, live)
        browser.get(f"{live.url}/#/compare?ids={','.join(ids)}")
        wait_for(
            browser,
            "window.trainctl.page && window.trainctl.page.kind === 'compare' && "
            "window.trainctl.page.plots !== null && "
            "!document.querySelector('#compare-inputs').hidden",
            "the comparison draws",
        )
        # The eval table and its charts come before the curves and what differs.
        order = browser.execute_script(
            "const ids = ['compare-evals', 'compare-eval-charts', 'compare-loss-chart',"
            " 'compare-inputs-card'];"
            "return ids.map((id) => document.getElementById(id).getBoundingClientRect().top);"
        )
        assert order == sorted(order), order
        assert browser.execute_script(
            "return Object.values(window.trainctl.page.plots.evals).every("
            "(p) => p.scales.y.distr === 3);"
        )
        groups = browser.execute_script(
            "return [...document.querySelectorAll('#compare-inputs details')].map((d) =>"
            " [d.dataset.group, Number(d.dataset.count), d.open,"
            "  d.querySelector('summary').textContent]);"
        )
        # Per-phase fields: the three lr_scale and warmup_steps, and the replay source added to
        # the second phase, more than five: folded. The optimizer's one field: open.
        assert [g[0] for g in groups] == ["phases", "optimizer"]
        assert groups[0][1] > 5 and groups[0][2] is False
        assert groups[1][1:3] == [1, True]
        phases_body = "#compare-inputs details[data-group='phases'] tbody"
        assert not browser.find_element(By.CSS_SELECTOR, phases_body).is_displayed()
        browser.save_screenshot(str(artifacts / "compare-folded.png"))
        browser.find_element(
            By.CSS_SELECTOR, "#compare-inputs details[data-group='phases'] summary"
        ).click()
        assert browser.find_element(By.CSS_SELECTOR, phases_body).is_displayed()
        changed = browser.execute_script(
            'return [...document.querySelectorAll("#compare-inputs td[data-change]")]'
            ".map((td) => [td.closest('tr').dataset.field, td.dataset.change]);"
        )
        assert ["optimizer.adamw_lr", "changed"] in changed
        assert ["phases[0].lr_scale", "changed"] in changed
        browser.save_screenshot(str(artifacts / "compare-grouped.png"))
        assert_no_console_errors(browser)
