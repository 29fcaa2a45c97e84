from __future__ import annotations

from pathlib import Path
from typing import Any

from contracts.signature import (
    Digests,
    compute_signature,
    diff_components,
    sha256_file,
    sha256_path,
)
from contracts.workflow import Workflow

DOC: dict[str, Any] = {
    "name": "wf",
    "model": {"config": {"vocab_size": 64}},
    "tokenizer": "/t/tok.json",
    "microbatch_tokens": 64,
    "phases": [
        {
            "name": "pre",
            "objective": "continued_pretrain",
            "data": [{"path": "/d/a.jsonl"}],
            "sequence_length": 32,
            "microbatch_size": 2,
            "steps": 10,
        },
        {
            "name": "sft",
            "objective": "summarization",
            "data": [{"path": "/d/b.jsonl"}],
            "sequence_length": 32,
            "microbatch_size": 2,
            "steps": 4,
        },
    ],
}
DIGESTS = Digests(tokenizer="t" * 64, data={"/d/a.jsonl": "a" * 64, "/d/b.jsonl": "b" * 64})


def workflow(**phase1: Any) -> Workflow:
    doc = {**DOC, "phases": [DOC["phases"][0], {**DOC["phases"][1], **phase1}]}
    return Workflow.model_validate(doc)


def test_signature_is_stable_and_defaults_are_part_of_it() -> None:
    explicit = workflow(grad_accum=1)  # 1 is the default: the same workflow
    assert (
        compute_signature(workflow=workflow(), digests=DIGESTS).sha256
        == compute_signature(workflow=explicit, digests=DIGESTS).sha256
    )


def test_signature_changes_with_any_component() -> None:
    base = compute_signature(workflow=workflow(), digests=DIGESTS).sha256
    changed_data = DIGESTS.model_copy(update={"data": {**DIGESTS.data, "/d/b.jsonl": "c" * 64}})
    assert compute_signature(workflow=workflow(), digests=changed_data).sha256 != base
    assert compute_signature(workflow=workflow(steps=5), digests=DIGESTS).sha256 != base
    with_ckpt = DIGESTS.model_copy(update={"initial_checkpoint": "e" * 64})
    assert compute_signature(workflow=workflow(), digests=with_ckpt).sha256 != base


def test_initial_checkpoint_identity_is_its_content_not_its_path() -> None:
    digests = DIGESTS.model_copy(update={"initial_checkpoint": "e" * 64})
    here = compute_signature(workflow=workflow(), digests=digests, initial_checkpoint="/a/x")
    there = compute_signature(workflow=workflow(), digests=digests, initial_checkpoint="/b/x")
    assert here.sha256 == there.sha256
    assert diff_components(here.components, there.components) == []


def test_diff_names_every_differing_field_with_both_values() -> None:
    stored = compute_signature(
        workflow=workflow(),
        digests=DIGESTS.model_copy(update={"initial_checkpoint": "e" * 64}),
        initial_checkpoint="/ckpt",
    )
    given = compute_signature(workflow=workflow(steps=7), digests=DIGESTS)
    diffs = {
        d.field: (d.stored, d.given) for d in diff_components(stored.components, given.components)
    }
    assert diffs == {
        "phases[1].steps": (4, 7),
        "initial_checkpoint.sha256": ("e" * 64, None),
    }


def test_diff_names_a_changed_data_file() -> None:
    other = DIGESTS.model_copy(update={"data": {**DIGESTS.data, "/d/a.jsonl": "f" * 64}})
    a = compute_signature(workflow=workflow(), digests=DIGESTS).components
    b = compute_signature(workflow=workflow(), digests=other).components
    [diff] = diff_components(a, b)
    assert diff.field == 'data["/d/a.jsonl"].sha256'
    assert (diff.stored, diff.given) == ("a" * 64, "f" * 64)


def test_sha256_of_a_directory_covers_names_and_contents(tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "weights.bin").write_bytes(b"\x00\x01")
    first = sha256_path(d)
    assert first == sha256_path(d)
    (d / "weights.bin").write_bytes(b"\x00\x02")
    second = sha256_path(d)
    assert second != first
    (d / "weights.bin").rename(d / "other.bin")
    assert sha256_path(d) != second
    assert sha256_path(d / "config.json") == sha256_file(d / "config.json")


# The signature of DOC as this version computes it. Every stored run was signed so: a change
# to the schema's defaults or to the signed components changes it, and then no run created
# before can be resumed (its resume answers signature_mismatch). Change this value only
# deliberately, bumping ENCODER_VERSION or saying so in the release notes.
FROZEN = "984a9fa38b7f94b9973f0cd56032b34d4f403ca4f414eb58ae172bd12bb1d574"


def test_the_signature_of_a_workflow_does_not_change_by_accident() -> None:
    assert compute_signature(workflow=workflow(), digests=DIGESTS).sha256 == FROZEN


def test_the_encoding_rules_are_signed() -> None:
    from contracts.workflow import ENCODER_VERSION

    signature = compute_signature(workflow=workflow(), digests=DIGESTS)
    assert signature.components["encoder_version"] == ENCODER_VERSION
    older = {**signature.components, "encoder_version": ENCODER_VERSION - 1}
    differences = diff_components(older, signature.components)
    assert [(d.field, d.stored, d.given) for d in differences] == [
        ("encoder_version", ENCODER_VERSION - 1, ENCODER_VERSION)
    ]


def test_optimizer_state_is_signed_only_when_it_carries() -> None:
    base = compute_signature(workflow=workflow(), digests=DIGESTS)
    reset = compute_signature(workflow=workflow(optimizer_state="reset"), digests=DIGESTS)
    carry = compute_signature(workflow=workflow(optimizer_state="carry"), digests=DIGESTS)
    # The default is left out of the normalised form: runs signed before the field existed
    # keep their signature (FROZEN above), and "reset" written out is the same run.
    assert reset.sha256 == base.sha256 == FROZEN
    assert carry.sha256 != base.sha256
    [diff] = diff_components(base.components, carry.components)
    assert (diff.field, diff.stored, diff.given) == ("phases[1].optimizer_state", "reset", "carry")
    assert Workflow.model_validate(carry.components["workflow"]).phases[1].optimizer_state == (
        "carry"
    )


def test_eval_sets_sign_by_name_and_the_default_name_signs_as_before() -> None:
    evals = [{"task": "qa_reasoning", "data": "/d/b.jsonl"}]
    unnamed = Workflow.model_validate({**DOC, "evals": evals})
    named = Workflow.model_validate({**DOC, "evals": [{**evals[0], "name": "qa_reasoning"}]})
    other = Workflow.model_validate({**DOC, "evals": [{**evals[0], "name": "qa-rag"}]})
    # The signature of this workflow before eval sets had names.
    assert (
        compute_signature(workflow=unnamed, digests=DIGESTS).sha256
        == "1ceb180b279962023641f492d234b95c1bc6ce08832e60a11e154a503deec35a"
    )
    assert (
        compute_signature(workflow=named, digests=DIGESTS).sha256
        == compute_signature(workflow=unnamed, digests=DIGESTS).sha256
    )
    renamed = diff_components(
        compute_signature(workflow=unnamed, digests=DIGESTS).components,
        compute_signature(workflow=other, digests=DIGESTS).components,
    )
    assert [(d.field, d.stored, d.given) for d in renamed] == [
        ("evals[0].name", "qa_reasoning", "qa-rag")
    ]


def test_a_replay_role_is_signed_and_the_default_role_is_not() -> None:
    def with_role(role: str | None) -> Workflow:
        pre = {**DOC["phases"][0], **({} if role is None else {"role": role})}
        return Workflow.model_validate({**DOC, "phases": [pre, DOC["phases"][1]]})

    base = compute_signature(workflow=with_role(None), digests=DIGESTS)
    train = compute_signature(workflow=with_role("train"), digests=DIGESTS)
    replay = compute_signature(workflow=with_role("replay"), digests=DIGESTS)
    # Workflows written before roles keep their signature (FROZEN above).
    assert train.sha256 == base.sha256 == FROZEN
    assert replay.sha256 != base.sha256
    [diff] = diff_components(base.components, replay.components)
    assert (diff.field, diff.stored, diff.given) == ("phases[0].role", "train", "replay")
    assert Workflow.model_validate(replay.components["workflow"]).phases[0].role == "replay"


def test_resources_are_never_signed_and_stay_in_the_stored_form() -> None:
    base = compute_signature(workflow=workflow(), digests=DIGESTS)
    on_two = Workflow.model_validate(
        {**DOC, "resources": {"devices": 2}, "phases": [DOC["phases"][0], DOC["phases"][1]]}
    )
    phase_on_four = workflow(resources={"devices": 4}, grad_accum=4)
    assert compute_signature(workflow=on_two, digests=DIGESTS).sha256 == base.sha256 == FROZEN
    # grad_accum is signed (it is the global batch); the device count it divides over is not.
    four = compute_signature(workflow=phase_on_four, digests=DIGESTS)
    assert [d.field for d in diff_components(base.components, four.components)] == [
        "phases[1].grad_accum"
    ]
    assert "resources" not in four.components["workflow"]["phases"][1]
    # Where the run trains is kept where the workflow is stored.
    assert on_two.normalized()["resources"] == {"devices": 2}
    assert phase_on_four.normalized()["phases"][1]["resources"] == {"devices": 4}
    assert "resources" not in workflow().normalized()
    assert [on_two.phase_devices(i) for i in (0, 1)] == [2, 2]
    assert [phase_on_four.phase_devices(i) for i in (0, 1)] == [1, 4]


def test_keep_best_is_signed_only_when_it_names_a_set() -> None:
    evals = [{"name": "qa", "task": "qa_reasoning", "data": "/d/b.jsonl"}]
    checkpoint = {"every_steps": 5, "keep_last": 2}

    def signed(**extra: Any) -> Any:
        doc = {**DOC, "evals": evals, "checkpoint": {**checkpoint, **extra}}
        return compute_signature(workflow=Workflow.model_validate(doc), digests=DIGESTS)

    base, empty, kept = signed(), signed(keep_best=[]), signed(keep_best=["qa"])
    # Left out of the normalised form when empty: workflows from before it sign as they did.
    assert "keep_best" not in base.components["workflow"]["checkpoint"]
    assert empty.sha256 == base.sha256
    assert kept.sha256 != base.sha256
    [diff] = diff_components(base.components, kept.components)
    assert (diff.field, diff.stored, diff.given) == ("checkpoint.keep_best[0]", None, "qa")
