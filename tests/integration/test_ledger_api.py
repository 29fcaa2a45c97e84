"""The token ledger (`GET /runs/{id}/ledger`) on real Postgres: what a worker reported of each
source, phase by phase, against the plan; the realised replay share against the planned one;
and a read that costs what it returns."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_bounded_reads import add_points, engine_of, rows_touched
from test_leases import Claimant, start_run

from service.db import upgrade_database
from service.models import Run
from service.reads.ledger import token_ledger

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings(reaper_interval_seconds=3600))


@pytest.fixture(params=["postgres", "sqlite"])
def any_api(
    request: pytest.FixtureRequest,
    make_settings: SettingsFactory,
    make_api: ApiFactory,
    tmp_path: Path,
) -> Api:
    """The app on Postgres, and on the embedded SQLite."""
    if request.param == "postgres":
        return make_api(make_settings(reaper_interval_seconds=3600))
    url = f"sqlite:///{tmp_path / 'trainctl.db'}"
    upgrade_database(url)
    return make_api(make_settings(database_url=url, reaper_interval_seconds=3600))


def replaying(tiny_workflow: WorkflowFactory) -> dict[str, Any]:
    """Pretraining (10 steps of 128 tokens), then summarization (10 steps) replaying the
    pretraining text as a quarter of its tokens: replay 320 of 2,560 tokens planned, 12.5% of
    all and 25% of post-training tokens. Both phases have a source named `pretrain`."""
    doc = tiny_workflow(phases=2, steps=10)
    doc["phases"][1]["data"] = [
        {"path": "summaries.jsonl", "weight": 3},
        {"path": "pretrain.jsonl", "weight": 1, "objective": "continued_pretrain"},
    ]
    return doc


def report(worker: Claimant, step: int, values: dict[str, float]) -> None:
    points = [{"name": k, "step": step, "value": v} for k, v in values.items()]
    answer = worker.post("metrics", {"fencing_token": worker.secret, "points": points})
    assert answer.status_code == 200, answer.text


def ledger(api: Api, run_id: str) -> dict[str, Any]:
    answer = api.client.get(f"/runs/{run_id}/ledger", headers=api.admin)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_the_ledger_sets_each_phases_sources_trained_against_planned(
    any_api: Api, tiny_workflow: WorkflowFactory
) -> None:
    api = any_api
    run_id, attempt_id = start_run(api, replaying(tiny_workflow))
    before = ledger(api, run_id)
    # Nothing trained yet: zeros, not unknowns; the plan is all there.
    assert (before["trained_tokens"], before["replay_tokens"]) == (0, 0)
    assert before["planned_tokens"] == 2560 and before["planned_replay_tokens"] == 320
    assert before["planned_replay_share"] == 0.125
    assert before["planned_post_training_replay_share"] == 0.25
    assert before["replay_share"] is None
    sft = before["phases"][1]
    assert [(s["name"], s["replay"], s["planned_tokens"]) for s in sft["sources"]] == [
        ("summaries", False, 960),
        ("pretrain", True, 320),
    ]
    assert sft["planned_replay_share"] == 0.25

    pretraining = Claimant(api, attempt_id, api.worker, nonce="a")
    assert pretraining.claim().status_code == 200
    for step in range(1, 11):  # cumulative counts, as worker.train.ledger reports them
        tokens = 128.0 * step
        values = {"tokens/pretrain": tokens, "target_tokens/pretrain": tokens}
        report(pretraining, step, {**values, "epochs/pretrain": step / 4})
    assert pretraining.checkpoint(10).status_code == 200
    assert pretraining.finish("succeeded", 10).status_code == 200

    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    supervised = Claimant(api, run["attempts"][-1]["id"], api.worker, nonce="b")
    assert supervised.claim().status_code == 200
    for step, (summaries, pretrain) in enumerate([(128, 0), (256, 0), (256, 128)], start=11):
        report(
            supervised,
            step,
            {
                "tokens/summaries": summaries,
                "target_tokens/summaries": summaries // 4,
                "epochs/summaries": summaries / 1000,
                "tokens/pretrain": pretrain,
                "target_tokens/pretrain": pretrain,
                "epochs/pretrain": pretrain / 512,
            },
        )

    answer = ledger(api, run_id)
    assert answer["step"] == 13
    first, second = answer["phases"]
    assert (first["name"], first["first_step"], first["last_step"]) == ("phase0", 1, 10)
    (pretrain,) = first["sources"]
    assert (pretrain["trained_tokens"], pretrain["target_tokens"], pretrain["epochs"]) == (
        1280,
        1280,
        2.5,
    )
    assert (first["trained_tokens"], first["replay_share"]) == (1280, 0.0)
    # Phase 1's `pretrain` is read in its own steps only: its 128, not phase 0's 1280.
    summaries, replay = second["sources"]
    assert (summaries["trained_tokens"], summaries["target_tokens"]) == (256, 64)
    assert summaries["epochs"] == 0.256
    assert (replay["trained_tokens"], replay["target_tokens"], replay["epochs"]) == (128, 128, 0.25)
    assert (summaries["trained_share"], replay["trained_share"]) == (256 / 384, 128 / 384)
    assert (second["trained_tokens"], second["replay_share"]) == (384, 128 / 384)
    assert (answer["trained_tokens"], answer["replay_tokens"]) == (1664, 128)
    assert answer["replay_share"] == 128 / 1664
    assert answer["post_training_replay_share"] == 128 / 384


def test_a_phase_begun_without_counts_is_unknown_and_so_are_the_runs_totals(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """A worker from before the ledger reports no counts: the ledger says it does not know
    rather than that nothing was trained."""
    run_id, attempt_id = start_run(api, replaying(tiny_workflow))
    older = Claimant(api, attempt_id, api.worker, nonce="a")
    assert older.claim().status_code == 200
    report(older, 3, {"loss": 2.0})
    answer = ledger(api, run_id)
    first, second = answer["phases"]
    assert first["trained_tokens"] is None and first["sources"][0]["epochs"] is None
    assert second["trained_tokens"] == 0  # not begun
    assert answer["trained_tokens"] is None and answer["replay_share"] is None


def test_the_ledger_reads_a_point_per_count_however_many_steps_were_stored(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = replaying(tiny_workflow)
    doc["phases"][0]["steps"] = doc["phases"][1]["steps"] = 20_000
    created = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert created.status_code == 201, created.text
    run = created.json()
    with api.sessions.begin() as session:
        for name in ("tokens/pretrain", "target_tokens/pretrain", "epochs/pretrain"):
            add_points(session, run, name, list(range(1, 40_001)))
        for name in ("tokens/summaries", "target_tokens/summaries", "epochs/summaries"):
            add_points(session, run, name, list(range(20_001, 40_001)))
        session.get_one(Run, run["id"]).step = 40_000
    with api.sessions() as session, rows_touched(engine_of(api)) as rows:
        answer = token_ledger(session=session, run=session.get_one(Run, run["id"]))
    # add_points stores step / 2: each count is its phase's last step's.
    assert [p.trained_tokens for p in answer.phases] == [10_000, 40_000]
    assert answer.phases[1].sources[1].epochs == 20_000
    # Nine counts, one point each (and the run's row); every point would be 180,000.
    assert rows() <= 20, rows()
