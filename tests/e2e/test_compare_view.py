"""Comparing runs in the dashboard, in real headless Chromium against a live `trainctl serve`:
two runs that differ in one data file and one learning rate (a finished one and a running
one, reporting through the worker protocol), selected in the runs table; and a run's tags and
note edited on its page and used to filter the runs table.

Screenshots are kept in tests/e2e/artifacts/: compare-view.png (after a live update),
compare-identical.png, run-tags.png and runs-filtered.png.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from compare_support import (
    EVAL_SETS,
    FIRST_LR,
    SECOND_LR,
    differing_pair,
    loss_of,
    lr_of,
    perplexity_of,
    train,
)
from e2e_support import PRETRAIN_STEPS, SFT_STEPS, TOTAL_STEPS, live_stack
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = pytest.mark.integration

WAIT_SECONDS = 20
RUNNING_UNTIL = 38  # the second run's step: inside its second phase (31-45)


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


def sign_in(driver: WebDriver, url: str, token: str) -> None:
    driver.get(url + "/")
    wait_for(driver, "!document.querySelector('#token-view').hidden", "the token form shows")
    driver.find_element(By.ID, "token-input").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    wait_for(driver, "!document.querySelector('#runs-view').hidden", "the runs table shows")


def click(driver: WebDriver, by: str, what: str) -> None:
    """Find and click, again if the runs table was redrawn (every 5 s) in between."""
    for _ in range(5):
        try:
            driver.find_element(by, what).click()
            return
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{what} kept being redrawn before it could be clicked")


def rows_shown(driver: WebDriver) -> list[str]:
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll('#runs-table tbody tr')]"
            ".map((r) => r.dataset.runId);"
        )
    )


def test_compare_view_overlays_curves_tables_eval_sets_names_what_differs_and_follows(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        pair = differing_pair(
            live.api, tmp_path, pretrain_steps=PRETRAIN_STEPS, sft_steps=SFT_STEPS
        )
        first, second = pair.ids
        train(live.api, live.stack.worker_token, pair.first, 0, until=TOTAL_STEPS).close()
        running = train(live.api, live.stack.worker_token, pair.second, 1, until=RUNNING_UNTIL)
        assert live.run(first)["status"] == "succeeded"
        assert live.run(second)["status"] == "running"

        # Tick the two runs in the runs table (the first ticked is the reference), compare.
        sign_in(browser, live.url, live.admin_token)
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        compare = browser.find_element(By.ID, "compare-selected")
        assert not compare.is_enabled()
        for run_id in (first, second):
            click(browser, By.CSS_SELECTOR, f"#runs-table input.select-run[data-run-id='{run_id}']")
        assert browser.find_element(By.ID, "selected-count").text == "2 selected"
        assert compare.is_enabled()
        compare.click()
        wait_for(
            browser,
            "window.trainctl.page && window.trainctl.page.kind === 'compare' && "
            "window.trainctl.page.plots !== null",
            "the comparison draws its charts",
        )
        assert browser.execute_script("return location.hash;") == f"#/compare?ids={first},{second}"
        assert browser.find_element(By.ID, "compare-title").text == "Compare 2 runs"
        legend = browser.find_elements(By.CSS_SELECTOR, "#compare-runs li")
        assert [li.get_attribute("data-run-id") for li in legend] == [first, second]
        assert "reference" in legend[0].text and "baseline-lr" in legend[0].text

        # Overlaid curves: a line per run, each with its own points.
        steps, loss_a, loss_b = browser.execute_script(
            "return window.trainctl.page.plots.loss.data;"
        )
        assert steps == list(range(1, TOTAL_STEPS + 1))
        assert loss_a == [pytest.approx(loss_of(0, s)) for s in steps]
        assert loss_b[:RUNNING_UNTIL] == [
            pytest.approx(loss_of(1, s)) for s in steps[:RUNNING_UNTIL]
        ]
        assert all(v is None for v in loss_b[RUNNING_UNTIL:])
        lr_steps, lr_a, lr_b = browser.execute_script("return window.trainctl.page.plots.lr.data;")
        assert lr_steps == steps
        assert lr_a[9] == pytest.approx(lr_of(0, 10)) and lr_b[9] == pytest.approx(lr_of(1, 10))
        assert browser.execute_script(
            "const c = document.querySelector('#compare-loss-chart canvas');"
            "return c && c.width > 0;"
        )
        # Each run's phase boundaries, in its colour: both runs end phases at 30 and 45.
        boundaries = browser.execute_script("return window.trainctl.page.plots.boundaries();")
        assert sorted((b["step"], b["color"]) for b in boundaries) == sorted(
            (step, color)
            for step in (PRETRAIN_STEPS, PRETRAIN_STEPS + SFT_STEPS)
            for color in {boundaries[0]["color"], boundaries[-1]["color"]}
        )
        assert len({b["color"] for b in boundaries}) == 2

        # One chart per eval set, a line per run.
        charts = browser.execute_script("return Object.keys(window.trainctl.page.plots.evals);")
        assert sorted(charts) == sorted(EVAL_SETS)
        for name in EVAL_SETS:
            eval_steps, ppl_a, ppl_b = browser.execute_script(
                "return window.trainctl.page.plots.evals[arguments[0]].data;", name
            )
            assert eval_steps == list(range(0, TOTAL_STEPS + 1, 5))
            assert ppl_a == [pytest.approx(perplexity_of(0, name, s)) for s in eval_steps]
            assert ppl_b[:8] == [pytest.approx(perplexity_of(1, name, s)) for s in eval_steps[:8]]
            assert all(v is None for v in ppl_b[8:])

        # The table: eval sets by runs, baseline / final / best, change against the first run.
        cells = browser.execute_script(
            "const tds = document.querySelectorAll('#compare-evals tbody td[data-run]');"
            "return Object.fromEntries([...tds].map((td) => ["
            "`${td.closest('tr').dataset.set}|${td.dataset.run}|${td.dataset.field}`,"
            "[td.textContent, td.className]]));"
        )
        for name in EVAL_SETS:
            assert cells[f"{name}|{first}|final"][0].endswith(f"@ {TOTAL_STEPS}")
            assert cells[f"{name}|{second}|final"][0].endswith("@ 35")
            assert cells[f"{name}|{first}|baseline"][0].endswith("@ 0")
            change = 100 * (perplexity_of(1, name, 35) / perplexity_of(0, name, TOTAL_STEPS) - 1)
            text, classes = cells[f"{name}|{second}|change"]
            assert text == f"+{change:.1f}%" and "worse" in classes, (name, text, change)

        # What differs: the data file (same path, new content) and the learning rate.
        differs = browser.execute_script(
            "const trs = document.querySelectorAll('#compare-inputs tbody tr');"
            "return Object.fromEntries([...trs].map((tr) => [tr.dataset.field,"
            "[...tr.querySelectorAll('td.value .shown')].map((td) => td.textContent)]));"
        )
        assert differs == {
            "optimizer.adamw_lr": [str(FIRST_LR), str(SECOND_LR)],
            f'data["{pair.data_path}"].sha256': [pair.sha_before, pair.sha_after],
        }
        assert browser.find_element(By.ID, "compare-identical").is_displayed() is False
        assert_no_console_errors(browser)

        # Live: the running run reports more and the comparison follows, no reload.
        phase = pair.second["plan"]["phases"][1]["name"]
        running.metrics(1, range(RUNNING_UNTIL + 1, 43))
        running.evals(1, 40, phase)
        running.heartbeat(42)
        wait_for(
            browser,
            "window.trainctl.page.plots.loss.data[2][41] !== null && "
            "window.trainctl.page.plots.loss.data[2][41] !== undefined",
            "the running run's new loss points reach the chart",
        )
        final_b = json.dumps(f"#compare-evals td[data-run='{second}'][data-field='final']")
        wait_for(
            browser,
            f"document.querySelector({final_b}).textContent.endsWith('@ 40')",
            "the new evaluation reaches the table",
        )
        assert browser.execute_script(
            "return window.trainctl.page.plots.evals['summarization'].data[2][8];"
        ) == pytest.approx(perplexity_of(1, "summarization", 40))
        assert browser.find_element(By.ID, "compare-live").text.startswith("updating every")
        browser.save_screenshot(str(artifacts / "compare-view.png"))
        assert_no_console_errors(browser)

        # Identical inputs say so: a second run of the second's workflow, on the same file.
        again = live.api.post(
            "/runs", json={"workflow_id": pair.second["workflow_id"], "name": "same-inputs"}
        )
        assert again.status_code == 201, again.text
        browser.get(f"{live.url}/#/compare?ids={second},{again.json()['id']}")
        wait_for(
            browser,
            "!document.querySelector('#compare-identical').hidden",
            "the comparison says the inputs are identical",
        )
        assert browser.find_element(By.ID, "compare-identical").text.startswith("Identical inputs:")
        assert not browser.find_element(By.ID, "compare-inputs").is_displayed()
        browser.save_screenshot(str(artifacts / "compare-identical.png"))
        assert_no_console_errors(browser)
        running.close()


def test_tags_and_note_are_edited_on_the_run_page_and_filter_the_runs_table(
    tmp_path: Path, postgres_url: str, redis_url: str, browser: WebDriver, artifacts: Path
) -> None:
    with live_stack(tmp_path, postgres_url, redis_url) as live:
        pair = differing_pair(
            live.api, tmp_path, pretrain_steps=PRETRAIN_STEPS, sft_steps=SFT_STEPS
        )
        first, second = pair.ids
        running = train(live.api, live.stack.worker_token, pair.first, 0, until=12)

        sign_in(browser, live.url, live.admin_token)
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        click(browser, By.LINK_TEXT, "baseline-lr")
        wait_for(browser, "window.trainctl.page && window.trainctl.page.run !== null", "run page")
        assert browser.find_element(By.ID, "run-tags").text == "no tags"
        browser.find_element(By.ID, "edit-run").click()
        name = browser.find_element(By.ID, "edit-name")
        assert name.get_attribute("value") == "baseline-lr"
        name.clear()
        name.send_keys("lr 3e-3 (reference)")
        browser.find_element(By.ID, "edit-tags").send_keys("baseline, lr-sweep  baseline")
        browser.find_element(By.ID, "edit-note").send_keys("the reference for the lr sweep")
        browser.find_element(By.CSS_SELECTOR, "#run-edit button[type=submit]").click()
        wait_for(browser, "document.querySelector('#run-edit').hidden", "the form closes")
        wait_for(
            browser,
            "document.querySelector('#run-title').textContent === 'lr 3e-3 (reference)'",
            "the new name shows",
        )
        assert not browser.find_element(By.ID, "run-edit").is_displayed()
        assert browser.find_element(By.ID, "edit-run").is_displayed()
        # Read in the page, in one call: the live run page redraws its tags on every poll, so
        # elements found a moment earlier may be gone (a stale reference failed here once).
        wait_for(
            browser,
            "JSON.stringify([...document.querySelectorAll('#run-tags .tag')]"
            '.map(chip => chip.textContent.trim())) === \'["baseline","lr-sweep"]\'',
            "the tags show, deduplicated, in order",
        )
        wait_for(
            browser,
            "document.querySelector('#run-note').textContent.trim() === "
            "'the reference for the lr sweep'",
            "the note shows",
        )
        stored = live.run(first)
        assert (stored["name"], stored["tags"], stored["note"]) == (
            "lr 3e-3 (reference)",
            ["baseline", "lr-sweep"],
            "the reference for the lr sweep",
        )
        browser.save_screenshot(str(artifacts / "run-tags.png"))
        assert_no_console_errors(browser)

        # The runs table shows the tags and filters by tag, name and status.
        live.api.patch(f"/runs/{second}", json={"tags": ["lr-sweep"]})
        browser.find_element(By.CSS_SELECTOR, ".topbar nav a").click()
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        browser.find_element(By.ID, "filter-tag").send_keys("baseline")
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 1", "1 row")
        assert rows_shown(browser) == [first]
        browser.find_element(By.ID, "filter-clear").click()
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        browser.find_element(By.ID, "filter-name").send_keys("LOWER")
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 1", "row")
        assert rows_shown(browser) == [second]
        browser.find_element(By.ID, "filter-name").clear()
        browser.find_element(By.ID, "filter-name").send_keys("nothing like it")
        wait_for(browser, "!document.querySelector('#runs-none-match').hidden", "no match")
        browser.find_element(By.ID, "filter-clear").click()
        browser.execute_script(
            "const s = document.querySelector('#filter-status'); s.value = 'running';"
            "s.dispatchEvent(new Event('input'));"
        )
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 1", "row")
        assert rows_shown(browser) == [first]
        # A tag chip in the table filters by it.
        browser.find_element(By.ID, "filter-clear").click()
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        click(
            browser,
            By.CSS_SELECTOR,
            f"#runs-table tr[data-run-id='{second}'] .tag[data-tag='lr-sweep']",
        )
        wait_for(
            browser, "document.querySelector('#filter-tag').value === 'lr-sweep'", "tag filter"
        )
        wait_for(browser, "document.querySelectorAll('#runs-table tbody tr').length === 2", "rows")
        browser.save_screenshot(str(artifacts / "runs-filtered.png"))
        assert_no_console_errors(browser)
        running.close()
