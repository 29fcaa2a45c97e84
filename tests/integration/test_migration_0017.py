"""Migration 0017: evaluations count the records they skipped, by reason, and name the first
few. Evaluations from before skipped none (their runs failed on such records): `{}` and `[]`.
The downgrade drops both columns and keeps every evaluation, on both databases."""

from __future__ import annotations

import pytest
from test_migration_0012 import columns, execute, rows

from service.db import downgrade_database, upgrade_database

pytestmark = pytest.mark.integration

EVALS = (
    "SELECT name, step, records, oversized_records, CAST(skipped_records AS TEXT), "
    "CAST(skipped_examples AS TEXT) FROM evals ORDER BY name, step"
)


def add_eval(name: str, step: int, **skipped: str) -> str:
    names = "".join(f", {column}" for column in skipped)
    values = "".join(f", '{value}'" for value in skipped.values())
    return (
        "INSERT INTO evals (run_id, name, step, task, attempt_id, phase, cross_entropy, "
        f"perplexity, records, target_tokens, oversized_records{names}) VALUES ('run_1', "
        f"'{name}', {step}, 'qa_reasoning', 'att_1', 'sft', 1.0, 2.7, 46, 460, 1{values})"
    )


def test_evaluations_from_before_skipped_nothing_and_survive_the_downgrade(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0016")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, created_at, "
        "updated_at) VALUES ('run_1', 'w1', 'r', 'succeeded', 's', '{}', '{}', 0, 4, 4, "
        "3, 3, :now, :now)",
        "INSERT INTO attempts (id, run_id, number, phase_index, status) "
        "VALUES ('att_1', 'run_1', 1, 0, 'succeeded')",
        add_eval("qa", 0),
        add_eval("qa", 4),
    )

    upgrade_database(url, "0017")
    assert rows(url, EVALS) == [("qa", 0, 46, 1, "{}", "[]"), ("qa", 4, 46, 1, "{}", "[]")]
    execute(
        url,
        add_eval(
            "qa-rag",
            0,
            skipped_records='{"malformed_json": 1}',
            skipped_examples='["qa.jsonl:5: not valid JSON"]',
        ),
    )
    assert rows(url, EVALS)[-1] == (
        "qa-rag",
        0,
        46,
        1,
        '{"malformed_json": 1}',
        '["qa.jsonl:5: not valid JSON"]',
    )

    downgrade_database(url, "0016")
    assert {"skipped_records", "skipped_examples"}.isdisjoint(columns(url, "evals"))
    assert rows(url, "SELECT name, step, records, oversized_records FROM evals ORDER BY 1, 2") == [
        ("qa", 0, 46, 1),
        ("qa", 4, 46, 1),
        ("qa-rag", 0, 46, 1),
    ]
    upgrade_database(url)
    assert rows(url, EVALS)[-1] == ("qa-rag", 0, 46, 1, "{}", "[]")
