"""The dashboard in real headless Chromium (Debian's chromium and chromedriver, through selenium)
against a live `trainctl serve` holding a finished run and a running one.

Screenshots are kept in tests/e2e/artifacts/: run-page.png (a running run, after a live update),
finished-run-page.png, runs-table.png, waiting-runs-table.png and waiting-run-page.png (a queued
run no worker serves), workers.png (the runs table with its workers panel) and eval-skipped.png
(the eval table's records scored and skipped, the sets past 2 % marked, and what they skipped).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    SETS,
    TOTAL_STEPS,
    LiveStack,
    eval_results,
    live_stack,
    metric_points,
    perplexity_at,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = pytest.mark.integration

WAIT_SECONDS = 20
# How the page writes a negative change (U+2212, not a hyphen).
MINUS = "\u2212"
SUMMARIZATION_CHANGE = "#eval-table tr[data-set='summarization'] td.change"


def wait_for(driver: WebDriver, script: str, what: str) -> Any:
    """The first truthy value of a JavaScript expression, polled until WAIT_SECONDS."""
    try:
        return WebDriverWait(driver, WAIT_SECONDS, poll_frequency=0.2).until(
            lambda d: d.execute_script(f"return ({script});")
        )
    except Exception as err:
        raise AssertionError(
            f"{what}: `{script}` stayed false for {WAIT_SECONDS} s\n{console(driver)}"
        ) from err


def console(driver: WebDriver) -> list[dict[str, Any]]:
    """The browser console's messages since the last call."""
    return list(driver.get_log("browser"))


def assert_no_console_errors(driver: WebDriver) -> None:
    errors = [m for m in console(driver) if m["level"] in ("SEVERE", "ERROR")]
    assert not errors, f"console errors: {errors}"


def sign_in(driver: WebDriver, live: LiveStack) -> None:
    """Open the dashboard and enter the token in its form, as a person does."""
    driver.get(live.url + "/")
    wait_for(driver, "!document.querySelector('#token-view').hidden", "the token form shows")
    driver.find_element(By.ID, "token-input").send_keys(live.admin_token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()


def open_run(driver: WebDriver, live: LiveStack, run_id: str) -> None:
    sign_in(driver, live)
    wait_for(driver, "!document.querySelector('#runs-view').hidden", "the runs table shows")
    driver.get(f"{live.url}/#/runs/{run_id}")
    wait_for(
        driver,
        "window.trainctl.page && window.trainctl.page.plots !== null && "
        "window.trainctl.page.plots.loss.data[0].length > 0",
        "the run page draws its loss chart",
    )


def ping_worker(live: LiveStack, *, hostname: str, pid: int, version: str) -> None:
    """A worker process saying it is there and serves the stack's queue, as `trainctl worker`
    does every few seconds."""
    body = {
        "hostname": hostname,
        "pid": pid,
        "version": version,
        "queue": live.stack.env["TRAINCTL_QUEUE"],
    }
    headers = {"Authorization": f"Bearer {live.stack.worker_token}"}
    response = httpx.post(
        f"{live.url}/internal/workers/ping", json=body, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text


def chart_points(driver: WebDriver, chart: str) -> list[list[Any]]:
    """A uPlot chart's data columns ([steps, series...]) on the open run page."""
    return list(driver.execute_script(f"return window.trainctl.page.plots.{chart}.data;"))


def test_runs_table_lists_runs_once_a_token_is_entered_and_explains_a_rejected_token(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        finished = live.finished_run()
        running, _ = live.running_run(until=38)

        # A wrong token: the page says what the service answered and asks again.
        browser.get(live.url + "/")
        wait_for(browser, "!document.querySelector('#token-view').hidden", "the token form")
        browser.find_element(By.ID, "token-input").send_keys("not-a-token")
        browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
        message = wait_for(
            browser,
            "!document.querySelector('#message').hidden && "
            "document.querySelector('#message').textContent",
            "a message about the rejected token",
        )
        assert "did not accept the token" in message and "401" in message, message
        assert browser.execute_script("return sessionStorage.getItem('trainctl.token');") is None
        console(browser)  # the refused request is logged by the browser; that one is expected

        browser.find_element(By.ID, "token-input").send_keys(live.admin_token)
        browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
        wait_for(
            browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "2 rows"
        )
        rows = {
            row.get_attribute("data-run-id"): [
                td.text for td in row.find_elements(By.TAG_NAME, "td")
            ]
            for row in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
        }
        assert set(rows) == {finished, running}
        run_cell, status, phase, steps, restarts, preemptions, age = rows[finished]
        assert finished in run_cell and "finished-e2e" in run_cell
        assert status == "succeeded"
        assert phase == "sft_planning (3 of 3)"
        assert steps.startswith(f"{TOTAL_STEPS} / {TOTAL_STEPS}")
        assert (restarts, preemptions) == ("0 / 3", "0 / 10")
        assert age.endswith(("s", "min"))
        assert rows[running][1:4] == [
            "running",
            "sft_summarization (2 of 3)",
            f"38 / {TOTAL_STEPS}",
        ]
        browser.save_screenshot(str(artifacts / "runs-table.png"))
        assert_no_console_errors(browser)

        # The token is kept for the session: a reload goes straight to the table.
        browser.refresh()
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        assert browser.execute_script("return document.querySelector('#token-view').hidden;")

        # Following a run's link opens its page.
        browser.find_element(By.LINK_TEXT, "running-e2e").click()
        wait_for(
            browser, "document.querySelector('#run-title').textContent === 'running-e2e'", "page"
        )
        assert_no_console_errors(browser)


def test_run_page_draws_curves_and_baselines_and_follows_live_updates(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        # Phase 0 (steps 1-30) done, phase 1 at step 38: one phase boundary inside the curves.
        run_id, worker = live.running_run(until=38)
        run = live.run(run_id)
        summarize = run["plan"]["phases"][1]
        open_run(browser, live, run_id)
        wait_for(browser, "window.trainctl.page.live === 'live'", "the page follows the events")

        # Training curves: uPlot drew its canvas, with every reported step.
        assert browser.execute_script(
            "const c = document.querySelector('#loss-chart canvas'); return c && c.width > 0;"
        )
        steps, loss = chart_points(browser, "loss")
        assert steps == list(range(1, 39)) and all(v is not None for v in loss)
        lr_steps, lr, lr_muon = chart_points(browser, "lr")
        assert lr_steps == steps and lr[0] is not None and lr_muon[0] is not None
        # Phase boundaries come from the run's plan: the pretrain phase ends at step 30.
        boundaries = browser.execute_script("return window.trainctl.page.plots.boundaries();")
        assert [b["step"] for b in boundaries] == [0, 30, 45]
        assert [b["name"] for b in boundaries][1] == "sft_summarization"

        # Evaluations: one chart per eval set (two of qa_reasoning), perplexity and the
        # baseline as a dashed line.
        charts = browser.execute_script("return Object.keys(window.trainctl.page.plots.evals);")
        assert sorted(charts) == sorted(SETS)
        # Read in one script: the live page redraws the table as evaluations arrive, and an
        # element found before a redraw is stale after it.
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#eval-table tbody tr')]"
            ".map((r) => [r.dataset.set, r.dataset.task]);"
        )
        assert dict(rows) == SETS
        for task in SETS:
            eval_steps, perplexity, baseline = browser.execute_script(
                "return window.trainctl.page.plots.evals[arguments[0]].data;", task
            )
            assert eval_steps[:8] == [0, 5, 10, 15, 20, 25, 30, 35], task
            assert perplexity[0] == pytest.approx(perplexity_at(task, 0))
            # The reference line spans the chart at the baseline's value, and is shown.
            assert baseline == [pytest.approx(perplexity_at(task, 0))] * len(eval_steps)
            assert browser.execute_script(
                "const s = window.trainctl.page.plots.evals[arguments[0]].series[2];"
                "return s.show && s.label === 'baseline' && s.dash.length === 2;",
                task,
            )
        text, classes = text_and_class(browser, SUMMARIZATION_CHANGE)
        expected = 100 * (
            perplexity_at("summarization", 35) / perplexity_at("summarization", 0) - 1
        )
        assert text == f"{MINUS}{abs(expected):.1f}%"
        assert "better" in classes

        # Checkpoints and attempts.
        checkpoint_steps = [
            int(row.get_attribute("data-step") or -1)
            for row in browser.find_elements(By.CSS_SELECTOR, "#checkpoints-table tbody tr")
        ]
        assert checkpoint_steps == [30, 20, 10]
        attempts = browser.find_elements(By.CSS_SELECTOR, "#attempts-table tbody tr")
        assert [a.get_attribute("data-status") for a in attempts] == ["running", "succeeded"]

        # Live: points reported after the page loaded appear without a reload.
        worker.metrics([p for s in (39, 40) for p in metric_points(s, summarize)])
        worker.evals(eval_results(40, summarize["name"]))
        worker.checkpoint(40, 1, 10)
        wait_for(
            browser,
            "window.trainctl.page.plots.loss.data[0].at(-1) === 40",
            "the new loss points reach the chart",
        )
        wait_for(
            browser,
            "window.trainctl.page.plots.evals['summarization'].data[0].includes(40)",
            "the new evaluation reaches its chart",
        )
        wait_for(
            browser,
            "document.querySelector('#checkpoints-table tbody tr').dataset.step === '40'",
            "the new checkpoint is listed",
        )
        assert browser.find_element(By.CSS_SELECTOR, "#run-facts").text.count("40 / 60") == 1
        expected = 100 * (
            perplexity_at("summarization", 40) / perplexity_at("summarization", 0) - 1
        )
        # The table is drawn anew with each update: find the cell again.
        change = browser.find_element(By.CSS_SELECTOR, SUMMARIZATION_CHANGE)
        assert change.text == f"{MINUS}{abs(expected):.1f}%"

        browser.save_screenshot(str(artifacts / "run-page.png"))
        assert_no_console_errors(browser)


def test_finished_run_page_shows_its_history_and_stops_following(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run_id = live.finished_run()
        open_run(browser, live, run_id)
        # The stream sent the final state and `end`: the page says it stopped following.
        wait_for(browser, "window.trainctl.page.live === 'ended'", "the stream ends")
        assert browser.find_element(By.ID, "live").text == "finished: no more updates"
        assert browser.find_element(By.ID, "run-status").text == "succeeded"

        steps, _ = chart_points(browser, "loss")
        assert steps == list(range(1, TOTAL_STEPS + 1))
        checkpoints = browser.find_elements(By.CSS_SELECTOR, "#checkpoints-table tbody tr")
        assert [int(c.get_attribute("data-step") or -1) for c in checkpoints] == [
            60,
            50,
            45,
            40,
            30,
            20,
            10,
        ]
        attempts = browser.find_elements(By.CSS_SELECTOR, "#attempts-table tbody tr")
        assert [a.get_attribute("data-status") for a in attempts] == ["succeeded"] * 3
        latest = browser.find_element(
            By.CSS_SELECTOR, "#eval-table tr[data-set='qa-rag'] td:nth-child(7)"
        )
        assert latest.text == str(TOTAL_STEPS)
        browser.save_screenshot(str(artifacts / "finished-run-page.png"))
        assert_no_console_errors(browser)


def test_a_queued_run_says_it_waits_for_a_worker_until_one_pings_and_the_workers_are_listed(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run_id = str(live.submit("queued-e2e")["id"])

        # Nobody was ever heard from: the run's row says it waits, the panel has no worker.
        sign_in(browser, live)
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 1", "row")
        row = browser.find_element(By.CSS_SELECTOR, f"#runs-table tr[data-run-id='{run_id}']")
        assert row.find_elements(By.TAG_NAME, "td")[1].text == "queued\nwaiting for a worker"
        wait_for(browser, "!document.querySelector('#workers-empty').hidden", "no workers")
        assert browser.find_element(By.ID, "workers-empty").text.startswith(
            "No worker has been heard from."
        )
        assert not browser.find_element(By.ID, "workers-table").is_displayed()
        assert browser.find_element(By.ID, "workers-count").text == "0 live of 0"
        browser.save_screenshot(str(artifacts / "waiting-runs-table.png"))
        assert_no_console_errors(browser)

        # The run page says so too ...
        browser.find_element(By.LINK_TEXT, "queued-e2e").click()
        wait_for(browser, "window.trainctl.page && window.trainctl.page.live === 'live'", "live")
        waiting = browser.find_element(By.ID, "run-waiting")
        assert waiting.is_displayed() and waiting.text.startswith("Waiting for a worker"), (
            waiting.text
        )
        assert browser.find_element(By.ID, "run-status").text == "queued"
        browser.save_screenshot(str(artifacts / "waiting-run-page.png"))

        # ... until a worker of its queue pings: the stream brings the change, no reload.
        ping_worker(live, hostname="e2e-gpu-1", pid=4242, version="0.1.0-e2e")
        wait_for(browser, "document.querySelector('#run-waiting').hidden", "the wait notice goes")
        assert_no_console_errors(browser)

        # The worker claims the run (ReportingWorker claims as e2e-gpu-1, pid 4242): the
        # panel lists it, live, with its version from the ping and the run it is running.
        live.claim_next(run_id)
        browser.find_element(By.CSS_SELECTOR, ".topbar nav a").click()
        wait_for(
            browser, "document.querySelectorAll('#workers-table tbody tr').length === 1", "worker"
        )
        worker = browser.find_element(By.CSS_SELECTOR, "#workers-table tbody tr")
        assert worker.get_attribute("data-live") == "true"
        host, version, queue, state, seen, running = [
            td.text for td in worker.find_elements(By.TAG_NAME, "td")
        ]
        assert (host, version, queue) == (
            "e2e-gpu-1:4242",
            "0.1.0-e2e",
            live.stack.env["TRAINCTL_QUEUE"],
        )
        assert state == "live" and seen.endswith(" s ago"), seen
        assert running == run_id
        assert browser.find_element(By.ID, "workers-count").text == "1 live of 1"
        assert browser.find_element(By.ID, "workers-empty").is_displayed() is False
        row = browser.find_element(By.CSS_SELECTOR, f"#runs-table tr[data-run-id='{run_id}']")
        assert row.find_elements(By.TAG_NAME, "td")[1].text == "running"
        browser.save_screenshot(str(artifacts / "workers.png"))

        # The worker's run link opens the run page, which no longer waits.
        worker.find_element(By.LINK_TEXT, run_id).click()
        wait_for(
            browser, "document.querySelector('#run-title').textContent === 'queued-e2e'", "page"
        )
        wait_for(browser, "document.querySelector('#run-status').textContent === 'running'", "run")
        assert not browser.find_element(By.ID, "run-waiting").is_displayed()
        assert_no_console_errors(browser)


def sign_in_with(driver: WebDriver, live: LiveStack, token: str) -> None:
    """Open the dashboard signed out and enter `token` in its form."""
    driver.get(live.url + "/")
    driver.execute_script("sessionStorage.clear();")
    driver.get(live.url + "/#/")
    driver.refresh()
    wait_for(driver, "!document.querySelector('#token-view').hidden", "the token form shows")
    driver.find_element(By.ID, "token-input").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    wait_for(driver, "!document.querySelector('#runs-view').hidden", "the runs table shows")


def test_a_viewer_reads_every_run_without_controls_and_a_user_controls_only_its_own(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        running, _ = live.running_run(until=38)
        viewer_token, user_token = live.stack.token("viewer"), live.stack.token("user")
        with httpx.Client(
            base_url=live.url, headers={"Authorization": f"Bearer {user_token}"}, timeout=30
        ) as as_user:
            admins = live.submit("template")["id"]  # an admin's run the user must not see
            # The user submits the same document (an admin's workflow id is not the user's).
            stored = live.api.get(f"/workflows/{live.run(admins)['workflow_id']}")
            assert stored.status_code == 200, stored.text
            body = {"workflow": stored.json()["workflow"], "name": "users-own"}
            created = as_user.post("/runs", json=body)
            assert created.status_code == 201, created.text
            own = created.json()["id"]

        # A viewer (a team screen): every run, no control anywhere.
        sign_in_with(browser, live, viewer_token)
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 3", "rows")
        assert browser.find_element(By.ID, "whoami").text == "viewer (viewer)"
        browser.get(f"{live.url}/#/runs/{running}")
        wait_for(browser, "window.trainctl.page && window.trainctl.page.live === 'live'", "live")
        assert browser.execute_script("return document.querySelector('#run-controls').hidden;")
        for button in ("pause-run", "resume-run", "cancel-run"):
            assert not browser.find_element(By.ID, button).is_displayed(), button
        browser.save_screenshot(str(artifacts / "viewer-run-page.png"))
        assert_no_console_errors(browser)

        # A user: its own run only, with the controls its status allows.
        browser.find_element(By.ID, "forget-token").click()
        sign_in_with(browser, live, user_token)
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 1", "row")
        assert (
            browser.find_element(By.CSS_SELECTOR, "#runs-table tbody tr").get_attribute(
                "data-run-id"
            )
            == own
        )
        assert browser.find_element(By.ID, "whoami").text == "user (user)"
        browser.find_element(By.LINK_TEXT, "users-own").click()
        wait_for(browser, "window.trainctl.page && window.trainctl.page.live === 'live'", "live")
        pause, resume, cancel = (
            browser.find_element(By.ID, b) for b in ("pause-run", "resume-run", "cancel-run")
        )
        assert pause.is_displayed() and pause.is_enabled()
        assert not resume.is_enabled() and cancel.is_enabled()
        pause.click()
        wait_for(
            browser, "document.querySelector('#run-status').textContent === 'paused'", "paused"
        )
        wait_for(browser, "!document.querySelector('#resume-run').disabled", "resume offered")
        assert not pause.is_enabled()
        browser.find_element(By.ID, "resume-run").click()
        wait_for(
            browser,
            "document.querySelector('#run-status').textContent === 'recovering'",
            "resumed",
        )
        browser.save_screenshot(str(artifacts / "user-run-page.png"))
        assert [
            e["action"] for e in live.api.get("/audit", params={"target_id": own}).json()["events"]
        ] == ["run.resume", "run.pause", "run.create"]

        # Another owner's run, asked for by its address: as if it did not exist.
        browser.get(f"{live.url}/#/runs/{running}")
        message = wait_for(
            browser,
            "!document.querySelector('#message').hidden && "
            "document.querySelector('#message').textContent",
            "a message about the missing run",
        )
        assert "run_not_found" in message, message


def skipped_results(step: int, phase: str, **by_set: dict[str, Any]) -> list[dict[str, Any]]:
    """eval_results at `step`, the sets in `by_set` with what they skipped."""
    results = eval_results(step, phase)
    for result in results:
        result.update(by_set.get(result["name"], {}))
    return results


def test_the_eval_table_shows_records_scored_and_skipped_and_marks_a_set_past_two_percent(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        run_id, worker = live.running_run(until=38)
        phase = live.run(run_id)["plan"]["phases"][1]["name"]
        # qa-rag skipped 2 of 48 (4.2 %: marked); summarization 1 of 100, too long (not).
        rag = {
            "records": 46,
            "skipped_records": {"malformed_json": 1, "wrong_shape": 1},
            "skipped_examples": [
                "/data/qa_rag.eval.jsonl:5: not valid JSON (Unterminated string starting at "
                "column 12)",
                "/data/qa_rag.eval.jsonl:10: a text record where qa_reasoning reads supervised "
                "records",
            ],
        }
        summaries = {
            "records": 99,
            "oversized_records": 1,
            "skipped_examples": [
                "/data/summarization.eval.jsonl:17: encodes to 300 tokens (prompt 290 + target "
                "and EOS 10), more than sequence_length + 1 = 257"
            ],
        }
        worker.evals(skipped_results(40, phase, **{"qa-rag": rag, "summarization": summaries}))
        open_run(browser, live, run_id)
        wait_for(browser, "window.trainctl.page.live === 'live'", "the page follows the events")

        cells = browser.execute_script(
            "return [...document.querySelectorAll('#eval-table tbody tr')].map((r) => ["
            "r.dataset.set, r.querySelector('td.scored').textContent,"
            "r.querySelector('td.skipped').textContent,"
            "r.querySelector('td.skipped').classList.contains('skipped-many')]);"
        )
        assert {set_: tuple(rest) for set_, *rest in cells} == {
            "continued_pretrain": ("8", "0", False),
            "instruction_tuning": ("8", "0", False),
            "qa_reasoning": ("8", "0", False),
            "qa-rag": ("46", "2 !", True),
            "retrieval_planning": ("8", "0", False),
            "summarization": ("99", "1", False),
        }
        listed = browser.execute_script(
            "return [...document.querySelectorAll('#eval-skipped > li')].map((li) => "
            "[li.dataset.set, li.firstChild.textContent + li.childNodes[1].textContent,"
            "[...li.querySelectorAll('code')].map((c) => c.textContent)]);"
        )
        assert listed == [
            [
                "qa-rag",
                "qa-rag skipped 2 of 48 records (4.2%): 1 malformed JSON, 1 wrong shape",
                rag["skipped_examples"],
            ],
            [
                "summarization",
                "summarization skipped 1 of 100 records (1.0%): 1 too long",
                summaries["skipped_examples"],
            ],
        ]

        # A set's first skipped records arrive live: counted at once, named once read.
        instruction = {
            "records": 37,
            "skipped_records": {"no_target": 3},
            "skipped_examples": ["/data/instruction.eval.jsonl:4: pair record with no target"],
        }
        sets = {"qa-rag": rag, "summarization": summaries, "instruction_tuning": instruction}
        worker.evals(skipped_results(45, phase, **sets))
        wait_for(
            browser,
            "document.querySelector(\"#eval-skipped li[data-set='instruction_tuning'] code\")",
            "the live set's first skipped records are listed",
        )
        skipped = browser.find_element(
            By.CSS_SELECTOR, "#eval-table tr[data-set='instruction_tuning'] td.skipped"
        )
        assert skipped.text == "3 !"
        listed = browser.execute_script(
            "return [...document.querySelectorAll('#eval-skipped > li')].map((li) => "
            "[li.dataset.set, li.classList.contains('skipped-many')]);"
        )
        assert listed == [["instruction_tuning", True], ["qa-rag", True], ["summarization", False]]
        browser.execute_script("document.querySelector('#eval-table').scrollIntoView();")
        browser.save_screenshot(str(artifacts / "eval-skipped.png"))
        assert_no_console_errors(browser)


def text_and_class(browser: Any, selector: str) -> tuple[str, str]:
    """The text and class of the element at `selector`, read again when a live update
    replaced the element between finding and reading it (a stale reference)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            element = browser.find_element(By.CSS_SELECTOR, selector)
            return element.text, element.get_attribute("class") or ""
        except StaleElementReferenceException:
            time.sleep(0.1)
    raise AssertionError(f"{selector} was replaced by every live update for 5 s")
