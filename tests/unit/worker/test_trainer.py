from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from contracts.reports import CheckpointRef, Claim
from contracts.workflow import Workflow
from worker.checkpoint.layout import (
    MANIFEST,
    MODEL_WEIGHTS,
    OPTIMIZER,
    checkpoints_dir,
    list_checkpoints,
    read_state,
    verify_checkpoint,
)
from worker.error import CheckpointError, NonFiniteLoss, SignatureMismatch
from worker.model.model import build_model
from worker.train.loop import PhaseOutcome, should_checkpoint, should_eval, train_phase
from worker.train.schedule import lr_multiplier

CPU = torch.device("cpu")


def run(claim: Claim, workflow: Workflow, reporter: Any, **kwargs: Any) -> PhaseOutcome:
    return train_phase(claim=claim, workflow=workflow, reporter=reporter, device=CPU, **kwargs)


def pretrain_phase(data: Path, *, steps: int) -> dict[str, Any]:
    """One continued-pretraining phase over `data`, the geometry from make_workflow."""
    return {"name": "pretrain", "objective": "continued_pretrain", "data": [data], "steps": steps}


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(path) / MODEL_WEIGHTS)


def test_checkpoint_and_eval_decisions() -> None:
    assert [s for s in range(1, 13) if should_checkpoint(s, every=5, last=12)] == [5, 10, 12]
    assert [s for s in range(0, 13) if should_eval(s, every=4, last=12)] == [0, 4, 8, 12]
    assert [s for s in range(11, 18) if should_eval(s, every=5, last=17)] == [15, 17]


def test_training_makes_the_loss_fall_and_reports_a_baseline_at_step_zero(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": 30,
                "grad_accum": 2,
                "schedule": {"kind": "cosine", "warmup_steps": 3},
            }
        ],
        evals=[
            {
                "task": "continued_pretrain",
                "data": make_text_file("held.jsonl", seed=9, documents=20),
                "every_steps": 10,
            }
        ],
        checkpoint={"every_steps": 10, "keep_last": 2},
    )
    reporter = make_reporter()
    outcome = run(make_claim(workflow), workflow, reporter)

    assert outcome.status == "succeeded" and outcome.step == 30
    assert [(r.step, r.phase) for r in reporter.eval_results] == [
        (0, "pretrain"),
        (10, "pretrain"),
        (20, "pretrain"),
        (30, "pretrain"),
    ]
    baseline, *_, final = reporter.eval_results
    assert final.cross_entropy < baseline.cross_entropy - 1.0
    assert final.target_tokens == baseline.target_tokens > 0

    assert sorted(reporter.metrics_by_step) == list(range(1, 31))
    assert set(reporter.metrics_by_step[1]) == {
        "loss",
        "lr",
        "lr_muon",
        "grad_norm",
        "tokens_per_s",
        # The token ledger (worker.train.ledger), for the phase's one source too.
        "tokens/pretrain",
        "target_tokens/pretrain",
        "epochs/pretrain",
    }
    losses = [reporter.metrics_by_step[s]["loss"] for s in range(1, 31)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    schedule = workflow.phases[0].schedule
    for step in (1, 3, 17, 30):
        expected = workflow.optimizer.adamw_lr * lr_multiplier(
            step, total_steps=30, schedule=schedule
        )
        assert reporter.metrics_by_step[step]["lr"] == pytest.approx(expected)

    assert [c.step for c in reporter.checkpoints] == [10, 20, 30]
    assert outcome.checkpoint == reporter.checkpoints[-1]
    assert outcome.checkpoint is not None
    directory = Path(outcome.checkpoint.path).parent
    assert [step for step, _ in list_checkpoints(directory)] == [30, 20]  # keep_last 2
    state = read_state(Path(outcome.checkpoint.path))
    assert (state.step, state.phase_step, state.tokens_seen) == (30, 30, 30 * 2 * 128)


def test_resume_matches_the_uninterrupted_run_bit_for_bit(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": 10,
                "grad_accum": 2,
            }
        ],
        model={"attention_dropout": 0.3},
        checkpoint={"every_steps": 4, "keep_last": 5},
    )
    straight_reporter = make_reporter()
    straight = run(make_claim(workflow, artifact_dir=tmp_path / "a"), workflow, straight_reporter)
    mid = next(c for c in straight_reporter.checkpoints if c.step == 4)

    # Dropout really draws random numbers in training: without the restored RNG a resumed run
    # would differ, so this test can fail.
    model = build_model(workflow, CPU)
    ids = torch.randint(0, 300, (2, 16))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)

    # A fresh process: every random stream is somewhere else.
    torch.manual_seed(12345)
    np.random.seed(123)
    random.seed(1)
    resumed_reporter = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "b", resume_from=mid)
    resumed = run(claim, workflow, resumed_reporter)

    assert sorted(resumed_reporter.metrics_by_step) == list(range(5, 11))
    for step in range(5, 11):
        assert (
            resumed_reporter.metrics_by_step[step]["loss"]
            == straight_reporter.metrics_by_step[step]["loss"]
        )
    assert straight.checkpoint is not None and resumed.checkpoint is not None
    a, b = weights(straight.checkpoint.path), weights(resumed.checkpoint.path)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt_a = torch.load(Path(straight.checkpoint.path) / OPTIMIZER, weights_only=True)
    opt_b = torch.load(Path(resumed.checkpoint.path) / OPTIMIZER, weights_only=True)
    for name, state in opt_a["muon"]["state"].items():
        assert torch.equal(
            state["momentum_buffer"], opt_b["muon"]["state"][name]["momentum_buffer"]
        )

    # Negative control: the same resume without restoring the RNG draws other dropout masks.
    unrestored_reporter = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "c", resume_from=mid)
    unrestored = run(claim, workflow, unrestored_reporter, restore_rng=False)
    assert unrestored.checkpoint is not None
    assert all(
        unrestored_reporter.metrics_by_step[step]["loss"]
        != straight_reporter.metrics_by_step[step]["loss"]
        for step in range(5, 11)
    )
    c = weights(unrestored.checkpoint.path)
    assert not any(torch.equal(a[name], c[name]) for name in a if name.endswith("proj.weight"))


def test_next_phase_starts_from_the_previous_phase_final_checkpoint(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    make_pairs_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": 4,
            },
            {
                "name": "sft",
                "objective": "instruction_tuning",
                "data": [
                    make_pairs_file(),
                    {
                        "path": str(make_text_file("replay.jsonl")),
                        "weight": 0.2,
                        "objective": "continued_pretrain",
                    },
                ],
                "steps": 7,
                "lr_scale": 0.5,
            },
        ],
        evals=[
            {
                "task": "instruction_tuning",
                "data": make_pairs_file("eval.jsonl", seed=3),
                "every_steps": 100,
            }
        ],
        checkpoint={"every_steps": 3, "keep_last": 2},
    )
    first = run(make_claim(workflow), workflow, make_reporter())
    assert first.checkpoint is not None and first.checkpoint.step == 4

    reporter = make_reporter()
    second = run(
        make_claim(workflow, phase_index=1, resume_from=first.checkpoint), workflow, reporter
    )

    assert second.status == "succeeded" and second.step == 11
    assert sorted(reporter.metrics_by_step) == list(range(5, 12))
    # A mixture reports each source's loss in the steps holding a microbatch of it, and the
    # realised token share so far, which follows the weights (5:1 here, 7 microbatches).
    last = reporter.metrics_by_step[11]
    assert last["token_share/replay"] + last["token_share/sft"] == pytest.approx(1.0)
    assert last["token_share/replay"] == pytest.approx(1 / 7)
    losses = [m for m in reporter.metrics_by_step.values() if "loss/replay" in m]
    assert len(losses) == 1 and losses[0]["loss/replay"] == pytest.approx(losses[0]["loss"])
    assert all("loss/sft" in m for m in reporter.metrics_by_step.values() if m not in losses)
    assert [c.step for c in reporter.checkpoints] == [6, 9, 11]
    assert [c.phase_step for c in reporter.checkpoints] == [2, 5, 7]
    # Phase 1's evals: at its last step only (no baseline outside the first phase).
    assert [(r.step, r.phase) for r in reporter.eval_results] == [(11, "sft")]
    # Work that reports nothing else still moves the progress a stall is judged by: the sft
    # source encoded into its token store (one batch of records) and opened; the replay source
    # opened only (its text is phase 0's, whose store it shares); each MiB of phase 0's final
    # checkpoint verified; the eval sets read (phase 0 built their store); the one eval set at
    # step 11.
    manifest = json.loads((Path(first.checkpoint.path) / MANIFEST).read_text())
    hashed = sum(math.ceil(f["size"] / 2**20) for f in manifest["files"].values())
    assert reporter.progress_calls == 2 + 1 + hashed + 1 + 1
    # The run showed the sft file being prepared, done before the first step.
    assert [f for f, share in reporter.prepared if share == 1.0] == [
        str(workflow.phases[1].data[0].path)
    ]
    base_lr = workflow.optimizer.adamw_lr * 0.5
    assert reporter.metrics_by_step[5]["lr"] == pytest.approx(
        base_lr * lr_multiplier(1, total_steps=7, schedule=workflow.phases[1].schedule)
    )
    # Retention keeps phase 0's final checkpoint beside the two newest.
    directory = Path(second.checkpoint.path).parent  # type: ignore[union-attr]
    assert [s for s, _ in list_checkpoints(directory)] == [11, 9, 4]
    state = read_state(directory / "step-00000011")
    assert (state.phase_index, state.phase_name, state.tokens_seen) == (1, "sft", 11 * 128)


def test_initial_checkpoint_supplies_the_starting_weights(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    held_out = make_text_file("held.jsonl", seed=9, documents=10)
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=5)],
        evals=[{"task": "continued_pretrain", "data": held_out}],
    )
    first_reporter = make_reporter()
    first = run(make_claim(workflow, artifact_dir=tmp_path / "a"), workflow, first_reporter)
    assert first.checkpoint is not None
    weights_file = tmp_path / "initial.safetensors"
    shutil.copy(Path(first.checkpoint.path) / MODEL_WEIGHTS, weights_file)

    for initial in (first.checkpoint.path, str(weights_file)):
        reporter = make_reporter()
        claim = make_claim(workflow, artifact_dir=tmp_path / "b", initial_checkpoint=initial)
        run(claim, workflow, reporter)
        baseline = reporter.eval_results[0]
        assert baseline.step == 0
        assert baseline.cross_entropy == first_reporter.eval_results[-1].cross_entropy


def test_a_stop_answer_stops_without_putting_a_save_in_flight_in_place(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=10)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    reporter = make_reporter(stop_at=3)
    outcome = run(make_claim(workflow), workflow, reporter)
    assert (outcome.status, outcome.step, outcome.checkpoint) == ("stopped", 3, None)
    assert max(reporter.metrics_by_step) == 3
    # Step 2's save was in flight: whether it finished before step 3's order or not, the
    # fencing check before its rename said stop, so it stays an unpublished temporary.
    assert reporter.checkpoints == []
    directory = checkpoints_dir(make_claim(workflow).artifact_dir)
    assert list_checkpoints(directory) == []
    (tmp,) = directory.iterdir()
    assert tmp.name.startswith(".tmp-step-00000002-")
    verify_checkpoint(tmp)  # finished writing its own directory, and nothing else


def test_a_pause_answer_checkpoints_now_and_ends_paused(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=8)],
        checkpoint={"every_steps": 100, "keep_last": 2},
    )
    reporter = make_reporter(pause_at=3)
    outcome = run(make_claim(workflow), workflow, reporter)
    assert (outcome.status, outcome.step) == ("paused", 3)
    assert [c.step for c in reporter.checkpoints] == [3]
    assert outcome.checkpoint == reporter.checkpoints[0]
    assert sorted(reporter.metrics_by_step) == [1, 2, 3]
    # The checkpoint was put in place only after a fencing check of its own.
    assert reporter.checks[-1] == (3, True)

    resumed = make_reporter()
    claim = make_claim(workflow, resume_from=outcome.checkpoint)
    assert run(claim, workflow, resumed).status == "succeeded"
    assert sorted(resumed.metrics_by_step) == [4, 5, 6, 7, 8]


def test_a_revived_zombie_writes_nothing_into_the_new_owners_checkpoints(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=6)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    owner = make_claim(workflow)
    run(owner, workflow, make_reporter())
    directory = checkpoints_dir(owner.artifact_dir)

    def contents() -> dict[str, bytes]:
        return {
            str(p.relative_to(directory)): p.read_bytes()
            for p in directory.rglob("*")
            if p.is_file() and not p.relative_to(directory).parts[0].startswith(".tmp-")
        }

    before = contents()
    assert sorted({k.split("/")[0] for k in before}) == ["step-00000004", "step-00000006"]

    class Zombie(type(make_reporter())):  # type: ignore[misc]
        """Its lease lapsed while it was stopped: every fencing check answers stop."""

        def check(self, step: int, *, now: bool = False) -> str:
            super().check(step, now=now)
            return "stop" if now else "continue"

    zombie = Zombie()
    outcome = run(owner.model_copy(update={"attempt_id": "zombie"}), workflow, zombie)
    assert outcome.status == "stopped" and zombie.checkpoints == []
    assert contents() == before  # no step directory added, replaced or deleted


def test_preemption_checkpoints_at_once(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=10)],
        checkpoint={"every_steps": 100, "keep_last": 2},
    )
    reporter = make_reporter()
    outcome = run(
        make_claim(workflow),
        workflow,
        reporter,
        stop_requested=lambda: len(reporter.metrics_by_step) >= 3,
    )
    assert (outcome.status, outcome.step) == ("preempted", 3)
    assert [c.step for c in reporter.checkpoints] == [3]
    assert outcome.checkpoint == reporter.checkpoints[0]


def test_a_non_finite_loss_fails_with_cause_nan(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=5)],
        optimizer={"adamw_lr": 1e30, "muon_lr": 1e30},
    )
    reporter = make_reporter()
    with pytest.raises(
        NonFiniteLoss, match=r"non-finite .* at step 2 \(phase 'pretrain'\)"
    ) as caught:
        run(make_claim(workflow), workflow, reporter)
    assert caught.value.cause == "nan"
    assert list(reporter.metrics_by_step) == [1] and reporter.checkpoints == []


def test_a_checkpoint_of_another_run_is_refused(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=4)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    reporter = make_reporter()
    run(make_claim(workflow), workflow, reporter)
    ref: CheckpointRef = reporter.checkpoints[0]
    with pytest.raises(SignatureMismatch, match="signature"):
        run(
            make_claim(workflow, resume_from=ref, signature="another-run"),
            workflow,
            make_reporter(),
        )


def _truncate(path: Path) -> None:
    weights = path / MODEL_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-100])


def _flip_a_byte(path: Path) -> None:
    optimizer = path / OPTIMIZER
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))


def _drop_manifest(path: Path) -> None:
    (path / MANIFEST).unlink()


@pytest.mark.parametrize("corrupt", [_flip_a_byte, _truncate, _drop_manifest])
def test_a_corrupt_resume_checkpoint_is_quarantined_and_the_previous_one_used(
    corrupt: Callable[[Path], None],
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=8)],
        checkpoint={"every_steps": 2, "keep_last": 5},
    )
    straight = make_reporter()
    run(make_claim(workflow, artifact_dir=tmp_path / "run"), workflow, straight)
    newest = next(c for c in straight.checkpoints if c.step == 6)
    directory = Path(newest.path).parent
    shutil.rmtree(directory / "step-00000008")  # as if killed before step 8's checkpoint
    corrupt(Path(newest.path))

    reporter = make_reporter()
    outcome = run(
        make_claim(workflow, artifact_dir=tmp_path / "run", resume_from=newest), workflow, reporter
    )

    assert outcome.resumed_from is not None
    assert (outcome.resumed_from.step, outcome.resumed_from.path) == (
        4,
        str(directory / "step-00000004"),
    )
    assert sorted(reporter.metrics_by_step) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert reporter.metrics_by_step[step]["loss"] == straight.metrics_by_step[step]["loss"]
    # Quarantined, not deleted, and out of every listing; a fresh step 6 replaced it.
    (quarantined,) = directory.glob("step-00000006.corrupt-*")
    assert quarantined.name.removeprefix("step-00000006.corrupt-").isdigit()
    assert (quarantined / MODEL_WEIGHTS).is_file()
    assert [s for s, _ in list_checkpoints(directory)] == [8, 6, 4, 2]


def test_without_a_usable_older_checkpoint_the_resume_fails_naming_it(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=4)],
        checkpoint={"every_steps": 2, "keep_last": 5},
    )
    reporter = make_reporter()
    run(make_claim(workflow, artifact_dir=tmp_path / "run"), workflow, reporter)
    first, second = reporter.checkpoints[:2]
    _drop_manifest(Path(first.path))
    _truncate(Path(second.path))
    resumed = make_reporter()
    with pytest.raises(
        CheckpointError, match=r"step-00000004 \(step 4\) failed.*no older complete checkpoint"
    ):
        run(
            make_claim(workflow, artifact_dir=tmp_path / "run", resume_from=second),
            workflow,
            resumed,
        )
    directory = Path(first.path).parent
    assert len(list(directory.glob("step-0000000[24].corrupt-*"))) == 2
    # Both were renamed aside: the service hears of each before the failure, or its registry
    # would hand them out again.
    assert [(step, status) for step, status, _ in resumed.removals] == [
        (4, "quarantined"),
        (2, "quarantined"),
    ]
    assert "model.safetensors has" in resumed.removals[0][2]
    assert f"no {MANIFEST}" in resumed.removals[1][2]


def test_retention_keeps_the_resume_checkpoint_until_a_newer_one_is_registered(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=8)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    first = make_reporter()
    run(make_claim(workflow), workflow, first, stop_requested=lambda: 4 in first.metrics_by_step)
    start = first.checkpoints[-1]
    assert start.step == 4
    directory = Path(start.path).parent
    # Leftovers of a dead attempt that got further but never registered these.
    for step in (7, 8):
        shutil.copytree(start.path, directory / f"step-{step:08d}")

    on_disk_at_registration: dict[int, list[int]] = {}

    class Recording(type(first)):  # type: ignore[misc]
        def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
            on_disk_at_registration[ref.step] = [s for s, _ in list_checkpoints(directory)]
            return super().checkpoint(ref)  # type: ignore[no-any-return]

    outcome = run(make_claim(workflow, resume_from=start), workflow, Recording())
    assert outcome.resumed_from is not None and outcome.resumed_from.step == 4
    # The start (4) is there when 6 is registered, and 6 (what the service now holds) is there
    # when 8 is: the leftovers 7 and 8 did not count as "newest".
    assert on_disk_at_registration == {6: [8, 7, 6, 4, 2], 8: [8, 7, 6, 4]}
    assert [s for s, _ in list_checkpoints(directory)] == [8, 7]


def test_retention_keeps_pinned_checkpoints_and_reports_each_deletion(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=10)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    # Another run starts from step 2: every registration's answer says it is pinned.
    reporter = make_reporter(pinned=[2])
    run(make_claim(workflow, artifact_dir=tmp_path / "run"), workflow, reporter)

    directory = checkpoints_dir(tmp_path / "run")
    assert [s for s, _ in list_checkpoints(directory)] == [10, 8, 2]
    assert [(step, status) for step, status, _ in reporter.removals] == [
        (4, "deleted"),
        (6, "deleted"),
    ]
    assert "keep_last 2" in reporter.removals[0][2]


def test_retention_keeps_a_checkpoint_whose_deletion_the_service_refused(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=8)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    # A run was created from step 2 after each registration's answer: the answers do not pin
    # it, the deletion report is refused as pinned, and the directory must stay.
    reporter = make_reporter(refused=[2])
    run(make_claim(workflow, artifact_dir=tmp_path / "run"), workflow, reporter)

    directory = checkpoints_dir(tmp_path / "run")
    assert [s for s, _ in list_checkpoints(directory)] == [8, 6, 2]
    # Reported before deleting: 2 at step 6's registration, 2 again and 4 at step 8's.
    assert [step for step, _, _ in reporter.removals] == [2, 4, 2]


def test_retention_deletes_nothing_while_its_reports_are_spooled(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=8)],
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    directory = checkpoints_dir(tmp_path / "run")
    on_disk_at_registration: dict[int, list[int]] = {}

    class BackAtEight(type(make_reporter())):  # type: ignore[misc]
        """The service takes every registration but cannot be reached for the deletion
        reports that follow step 6's: they are spooled."""

        def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
            on_disk_at_registration[ref.step] = [s for s, _ in list_checkpoints(directory)]
            self.unreachable = ref.step < 8
            return super().checkpoint(ref)  # type: ignore[no-any-return]

    reporter = BackAtEight()
    run(make_claim(workflow, artifact_dir=tmp_path / "run"), workflow, reporter)

    # Step 2 outlived its spooled report (a worker that deleted it then died before the spool
    # was sent would leave the registry listing a checkpoint that is gone); the retention at
    # step 8 reported it again, and deleted it once the service recorded that.
    assert on_disk_at_registration[8] == [8, 6, 4, 2]
    assert [step for step, _, _ in reporter.removals] == [2, 4, 2]
    assert [s for s, _ in list_checkpoints(directory)] == [8, 6]


def test_a_quarantined_resume_checkpoint_is_reported_with_why(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [pretrain_phase(make_text_file(), steps=6)],
        checkpoint={"every_steps": 2, "keep_last": 5},
    )
    first = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "run")
    run(claim, workflow, first, stop_requested=lambda: 4 in first.metrics_by_step)
    newest = first.checkpoints[-1]
    assert newest.step == 4
    _flip_a_byte(Path(newest.path))

    reporter = make_reporter()
    resumed = make_claim(workflow, artifact_dir=tmp_path / "run", resume_from=newest)
    outcome = run(resumed, workflow, reporter)

    assert outcome.resumed_from is not None and outcome.resumed_from.step == 2
    [(step, status, reason)] = reporter.removals
    assert (step, status) == (4, "quarantined")
    assert f"{OPTIMIZER} has SHA-256" in reason
    assert "kept as step-00000004.corrupt-" in reason


def _two_phases(text: Path, *, carry: str) -> list[dict[str, Any]]:
    """Pretraining (steps 1-4), then a replay phase over the same text (steps 5-10) whose
    `optimizer_state` is `carry`."""
    return [
        pretrain_phase(text, steps=4),
        {
            "name": "replay",
            "objective": "continued_pretrain",
            "data": [text],
            "steps": 6,
            "schedule": {"kind": "cosine", "warmup_steps": 2},
            "optimizer_state": carry,
        },
    ]


def optimizer_state(path: str | Path) -> dict[str, Any]:
    return torch.load(Path(path) / OPTIMIZER, weights_only=True)  # type: ignore[no-any-return]


def test_a_carried_phase_steps_on_from_the_previous_phase_optimizer_state(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    text = make_text_file()
    checkpoint = {"every_steps": 1, "keep_last": 10}
    reset = make_workflow(_two_phases(text, carry="reset"), checkpoint=checkpoint)
    carry = make_workflow(_two_phases(text, carry="carry"), checkpoint=checkpoint)
    first = run(make_claim(reset, artifact_dir=tmp_path / "first"), reset, make_reporter())
    assert first.checkpoint is not None and first.checkpoint.step == 4
    boundary = optimizer_state(first.checkpoint.path)

    after: dict[str, dict[str, Any]] = {}
    reporters = {}
    for name, workflow in (("reset", reset), ("carry", carry)):
        reporters[name] = make_reporter()
        claim = make_claim(
            workflow, phase_index=1, resume_from=first.checkpoint, artifact_dir=tmp_path / name
        )
        assert run(claim, workflow, reporters[name]).status == "succeeded"
        after[name] = optimizer_state(tmp_path / name / "checkpoints" / "step-00000005")

    # Step 5 is the same forward and backward in both (same weights, batch and phase seed), so
    # its gradient g is too: a reset optimizer's first step holds (1 - beta) g, a carried one
    # beta * (the boundary's state) + (1 - beta) g. The schedule is the phase's own in both.
    assert (
        reporters["carry"].metrics_by_step[5]["loss"]
        == reporters["reset"].metrics_by_step[5]["loss"]
    )
    assert (
        reporters["carry"].metrics_by_step[5]["lr"] == reporters["reset"].metrics_by_step[5]["lr"]
    )
    momentum = carry.optimizer.muon_momentum
    beta1, beta2 = carry.optimizer.adamw_betas
    for name, state in after["carry"]["muon"]["state"].items():
        expected = momentum * boundary["muon"]["state"][name]["momentum_buffer"]
        expected += after["reset"]["muon"]["state"][name]["momentum_buffer"]
        torch.testing.assert_close(state["momentum_buffer"], expected)
    for name, state in after["carry"]["adamw"]["state"].items():
        held, fresh = boundary["adamw"]["state"][name], after["reset"]["adamw"]["state"][name]
        assert (int(held["step"]), int(fresh["step"]), int(state["step"])) == (4, 1, 5)
        torch.testing.assert_close(state["exp_avg"], beta1 * held["exp_avg"] + fresh["exp_avg"])
        torch.testing.assert_close(
            state["exp_avg_sq"], beta2 * held["exp_avg_sq"] + fresh["exp_avg_sq"]
        )
    a = weights(tmp_path / "reset" / "checkpoints" / "step-00000005")
    b = weights(tmp_path / "carry" / "checkpoints" / "step-00000005")
    assert not any(torch.equal(a[n], b[n]) for n in a if n.endswith("proj.weight"))


def test_a_carried_phase_resumes_bit_for_bit_at_its_boundary_and_inside_it(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    # Dropout on: a resume that drew other random numbers would differ.
    workflow = make_workflow(
        _two_phases(make_text_file(), carry="carry"),
        model={"attention_dropout": 0.3},
        checkpoint={"every_steps": 2, "keep_last": 10},
    )
    first = run(make_claim(workflow, artifact_dir=tmp_path / "first"), workflow, make_reporter())
    assert first.checkpoint is not None and first.checkpoint.step == 4

    def phase_two(name: str, start: CheckpointRef) -> tuple[PhaseOutcome, Any]:
        reporter = make_reporter()
        claim = make_claim(workflow, phase_index=1, resume_from=start, artifact_dir=tmp_path / name)
        return run(claim, workflow, reporter), reporter

    straight, straight_reporter = phase_two("straight", first.checkpoint)
    # An attempt that dies after step 5, before its first checkpoint: the next one starts from
    # the boundary again, in a process whose random streams are elsewhere.
    dying = make_reporter()

    def die(step: int, values: dict[str, float]) -> None:
        type(dying).metrics(dying, step, values)
        if step == 5:
            raise KeyboardInterrupt

    dying.metrics = die
    with pytest.raises(KeyboardInterrupt):
        run(
            make_claim(
                workflow, phase_index=1, resume_from=first.checkpoint, artifact_dir=tmp_path / "b"
            ),
            workflow,
            dying,
        )
    torch.manual_seed(12345)
    np.random.seed(123)
    random.seed(1)
    boundary, boundary_reporter = phase_two("b", first.checkpoint)
    # Inside the carried phase, from its own step-8 checkpoint: its own optimizer state.
    mid = next(c for c in straight_reporter.checkpoints if c.step == 8)
    inside, inside_reporter = phase_two("inside", mid)

    assert straight.checkpoint is not None
    expected_weights = weights(straight.checkpoint.path)
    expected_optimizer = optimizer_state(straight.checkpoint.path)
    for outcome, reporter, steps in (
        (boundary, boundary_reporter, range(5, 11)),
        (inside, inside_reporter, range(9, 11)),
    ):
        assert outcome.status == "succeeded" and outcome.checkpoint is not None
        assert sorted(reporter.metrics_by_step) == list(steps)
        for step in steps:
            assert reporter.metrics_by_step[step] == straight_reporter.metrics_by_step[step] | {
                "tokens_per_s": reporter.metrics_by_step[step]["tokens_per_s"]
            }
        got = weights(outcome.checkpoint.path)
        assert got.keys() == expected_weights.keys()
        assert all(torch.equal(got[n], expected_weights[n]) for n in got)
        assert _same(optimizer_state(outcome.checkpoint.path), expected_optimizer)
    assert int(expected_optimizer["adamw"]["state"]["lm_head.weight"]["step"]) == 10


def _same(a: Any, b: Any) -> bool:
    """Nested optimizer states equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
