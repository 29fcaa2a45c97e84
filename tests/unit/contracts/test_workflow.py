from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts.bounds import EMPTY_PATH
from contracts.workflow import (
    Plan,
    WorkflowInvalid,
    json_path,
    path_fields,
    plan,
    replace_paths,
    validate_workflow,
)
from runtime.path import resolve_paths, validate_workflow_with_files

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "workflows"


def make_workflow(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """A small valid workflow whose files exist in tmp_path."""
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"source": "s", "target": "t"}\n')
    doc: dict[str, Any] = {
        "name": "wf",
        "model": {"config": {"vocab_size": 64, "max_position_embeddings": 64}},
        "tokenizer": str(tmp_path / "tok.json"),
        "microbatch_tokens": 64,
        "evals": [{"task": "summarization", "data": str(tmp_path / "b.jsonl")}],
        "phases": [
            {
                "name": "pre",
                "objective": "continued_pretrain",
                "data": [{"path": str(tmp_path / "a.jsonl")}],
                "sequence_length": 32,
                "microbatch_size": 2,
                "steps": 10,
            },
            {
                "name": "sft",
                "objective": "summarization",
                "data": [
                    {"path": str(tmp_path / "b.jsonl"), "weight": 3},
                    {"path": str(tmp_path / "a.jsonl"), "weight": 1},
                ],
                "sequence_length": 16,
                "microbatch_size": 4,
                "grad_accum": 2,
                "steps": 5,
            },
        ],
    }
    doc.update(overrides)
    return doc


def problems_of(doc: Any) -> dict[str, str]:
    """Every problem of `doc`, in the document and in the files it names."""
    with pytest.raises(WorkflowInvalid) as info:
        validate_workflow_with_files(doc)
    return {p.path: p.message for p in info.value.problems}


def test_valid_workflow_fills_defaults(tmp_path: Path) -> None:
    wf = validate_workflow(make_workflow(tmp_path))
    assert wf.checkpoint.keep_last == 2
    assert wf.phases[0].schedule.kind == "cosine"
    assert wf.normalized()["optimizer"]["muon_lr"] == 0.02


def test_every_problem_is_reported_at_once_with_paths(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][0]["objective"] = "pretraining"
    doc["phases"][1]["name"] = "pre"
    doc["phases"][1]["microbatch_size"] = 6
    doc["phases"][1]["data"][0]["path"] = str(tmp_path / "missing.jsonl")
    doc["phases"][1]["steps"] = 0
    doc["evals"][0]["data"] = str(tmp_path / "gone.jsonl")
    found = problems_of(doc)
    assert "unknown objective 'pretraining'" in found["phases[0].objective"]
    assert "duplicate phase name 'pre'" in found["phases[1].name"]
    assert found["phases[1]"] == (
        "sequence_length 16 x microbatch_size 6 = 96 tokens, but microbatch_tokens is 64"
    )
    assert "not found" in found["phases[1].data[0].path"]
    assert "phases[1].steps" in found
    assert "not found" in found["evals[0].data"]


def test_model_needs_exactly_one_source(tmp_path: Path) -> None:
    assert "model" in problems_of(make_workflow(tmp_path, model={}))
    both = {"config": {"vocab_size": 8}, "pretrained": str(tmp_path)}
    assert "model" in problems_of(make_workflow(tmp_path, model=both))


def test_unknown_fields_are_refused(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][0]["sequence_len"] = 32
    assert problems_of(doc)["phases[0].sequence_len"] == "unknown field"


def test_sequence_longer_than_model_positions_is_refused(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["model"]["config"]["max_position_embeddings"] = 16
    assert "exceeds" in problems_of(doc)["phases[0].sequence_length"]


def test_warmup_longer_than_phase_is_refused(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["schedule"] = {"warmup_steps": 9}
    assert "longer than the phase" in problems_of(doc)["phases[1].schedule.warmup_steps"]


def test_keep_last_below_two_is_refused(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path, checkpoint={"every_steps": 5, "keep_last": 1})
    assert "checkpoint.keep_last" in problems_of(doc)


def test_non_object_document_is_refused() -> None:
    assert problems_of([1, 2]) == {"$": "a workflow must be a JSON object"}


def test_plan_totals_and_shares(tmp_path: Path) -> None:
    result = plan(validate_workflow(make_workflow(tmp_path)))
    assert result.total_steps == 15
    # pre: 10 steps x 64 tokens; sft: 5 steps x 64 tokens x 2 accumulation.
    assert [p.compute_tokens for p in result.phases] == [640, 640]
    assert result.compute_tokens == 1280
    assert [p.token_share for p in result.phases] == [0.5, 0.5]
    assert (result.phases[1].first_step, result.phases[1].last_step) == (11, 15)
    assert [s.token_share for s in result.phases[1].sources] == [0.75, 0.25]


def test_validation_reads_no_files(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["tokenizer"] = "/nowhere/tok.json"
    doc["model"] = {"pretrained": "/nowhere/model"}
    doc["evals"][0]["data"] = "/nowhere/eval.jsonl"
    assert validate_workflow(doc).tokenizer == "/nowhere/tok.json"


def test_path_fields_name_every_file_with_its_kind_in_document_order(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path, model={"pretrained": "m"})
    assert [(json_path(loc), value, kind) for loc, value, kind in path_fields(doc)] == [
        ("model.pretrained", "m", "directory"),
        ("tokenizer", str(tmp_path / "tok.json"), "path"),
        ("phases[0].data[0].path", str(tmp_path / "a.jsonl"), "file"),
        ("phases[1].data[0].path", str(tmp_path / "b.jsonl"), "file"),
        ("phases[1].data[1].path", str(tmp_path / "a.jsonl"), "file"),
        ("evals[0].data", str(tmp_path / "b.jsonl"), "file"),
    ]
    # Whatever does not parse is left to the structural checks.
    assert path_fields({"tokenizer": 3, "phases": [1, {"data": "x"}], "evals": {}}) == []


def test_replace_paths_rewrites_only_path_fields_in_a_copy(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    out = replace_paths(doc, str.upper)
    assert out["tokenizer"] == str(tmp_path / "tok.json").upper()
    assert out["evals"][0]["data"] == str(tmp_path / "b.jsonl").upper()
    assert out["phases"][1]["name"] == "sft"
    assert doc["tokenizer"] == str(tmp_path / "tok.json"), "the input document is not modified"


def test_json_path_formats_indices() -> None:
    assert json_path(("phases", 2, "data", 0, "path")) == "phases[2].data[0].path"
    assert json_path(()) == "$"


def test_shipped_demo_workflow_is_valid() -> None:
    path = EXAMPLES / "demo.json"
    wf = validate_workflow(resolve_paths(json.loads(path.read_text()), path.parent))
    assert len(wf.phases) >= 3
    assert {e.task for e in wf.evals} >= {
        "continued_pretrain",
        "summarization",
        "instruction_tuning",
        "qa_reasoning",
        "retrieval_planning",
    }


def test_unusable_paths_and_values_are_problems_not_crashes(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["tokenizer"] = "tok\0.json"
    doc["phases"][0]["data"][0]["path"] = "/" + "x" * 5000
    doc["phases"][1]["data"][0]["path"] = str(tmp_path)  # a directory, not a file
    doc["phases"][0]["steps"] = 10**19
    doc["optimizer"] = {"muon_lr": float("inf")}
    doc["name"] = "n" * 201
    found = problems_of(resolve_paths(doc, tmp_path))
    assert "not a usable path" in found["tokenizer"]
    assert "not a usable path" in found["phases[0].data[0].path"]
    assert "not a regular file" in found["phases[1].data[0].path"]
    assert "phases[0].steps" in found
    assert "optimizer.muon_lr" in found
    assert "name" in found


# --- data sources: geometry, names, replay --------------------------------------------------


def replay_source(tmp_path: Path, **geometry: Any) -> dict[str, Any]:
    """Pretraining text replayed in the sft phase, with the pretraining phase's geometry."""
    return {
        "path": str(tmp_path / "a.jsonl"),
        "weight": 1,
        "objective": "continued_pretrain",
        "sequence_length": 32,
        "microbatch_size": 2,
        **geometry,
    }


def test_a_replay_source_with_its_own_geometry_filling_the_envelope_is_valid(
    tmp_path: Path,
) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["data"][1] = replay_source(tmp_path)
    wf = validate_workflow(doc)
    sft, replay = wf.phases[1].sources()
    assert (sft.name, sft.objective, sft.sequence_length, sft.microbatch_size) == (
        "b",
        "summarization",
        16,
        4,
    )
    assert (replay.name, replay.objective, replay.sequence_length, replay.microbatch_size) == (
        "a",
        "continued_pretrain",
        32,
        2,
    )


@pytest.mark.parametrize(
    ("geometry", "message"),
    [
        (
            {"microbatch_size": 3},
            "sequence_length 32 x microbatch_size 3 = 96 tokens, but microbatch_tokens is 64",
        ),
        # A source giving one of the two takes the other from its phase (microbatch_size 4).
        (
            {"microbatch_size": None},
            "sequence_length 32 x microbatch_size 4 = 128 tokens, but microbatch_tokens is 64",
        ),
    ],
)
def test_a_source_geometry_that_misses_the_envelope_is_refused_at_its_path(
    tmp_path: Path, geometry: dict[str, Any], message: str
) -> None:
    doc = make_workflow(tmp_path)
    source = replay_source(tmp_path, **geometry)
    doc["phases"][1]["data"][1] = {k: v for k, v in source.items() if v is not None}
    found = problems_of(doc)
    assert found == {"phases[1].data[1]": message}


def test_duplicate_source_names_in_a_phase_are_refused(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.train.jsonl").write_text('{"source": "s", "target": "t"}\n')
    doc = make_workflow(tmp_path)
    doc["phases"][1]["data"][1] = {"path": str(tmp_path / "other" / "b.train.jsonl")}
    found = problems_of(doc)
    assert list(found) == ["phases[1].data[1].name"]
    assert "duplicate source name 'b' (also data[0])" in found["phases[1].data[1].name"]

    doc["phases"][1]["data"][1]["name"] = "b_other"  # a distinct name settles it
    wf = validate_workflow(doc)
    assert [s.name for s in wf.phases[1].sources()] == ["b", "b_other"]


def test_sequence_lengths_beyond_the_model_positions_are_refused_for_sources_and_evals(
    tmp_path: Path,
) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["data"][1] = replay_source(tmp_path, sequence_length=128)
    doc["evals"][0]["sequence_length"] = 65
    doc["microbatch_tokens"] = 64
    found = problems_of(doc)
    assert found["phases[1].data[1].sequence_length"] == (
        "128 exceeds the model's max_position_embeddings 64"
    )
    assert found["evals[0].sequence_length"] == "65 exceeds the model's max_position_embeddings 64"


def test_an_eval_is_computed_at_the_longest_sequence_length_unless_given(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][0]["sequence_length"] = 16
    doc["phases"][0]["microbatch_size"] = 4
    doc["phases"][1]["data"][1] = replay_source(tmp_path)  # 32, the longest
    doc["evals"].append({"task": "continued_pretrain", "data": str(tmp_path / "a.jsonl")})
    doc["evals"][1]["sequence_length"] = 8
    wf = validate_workflow(doc)
    assert [wf.eval_sequence_length(e) for e in wf.evals] == [32, 8]
    assert (wf.evals[0].batch_size, wf.evals[0].sequence_length) == (8, None)


def test_plan_reports_each_source_token_share_and_the_replay_token_share(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["data"][1] = replay_source(tmp_path)
    doc["phases"].append(
        {
            "name": "instruct",
            "objective": "instruction_tuning",
            "data": [{"path": str(tmp_path / "b.jsonl")}],
            "sequence_length": 16,
            "microbatch_size": 4,
            "steps": 5,
        }
    )
    result = plan(validate_workflow(doc))
    pre, sft, instruct = result.phases
    assert [p.compute_tokens for p in result.phases] == [640, 640, 320]
    sources = [
        (s.name, s.objective, s.sequence_length, s.microbatch_size, s.token_share, s.compute_tokens)
        for s in sft.sources
    ]
    assert sources == [
        ("b", "summarization", 16, 4, 0.75, 480),
        ("a", "continued_pretrain", 32, 2, 0.25, 160),
    ]
    # Replay is counted in supervised phases only: pretraining text there is its own objective.
    assert (pre.replay_token_share, sft.replay_token_share, instruct.replay_token_share) == (
        0.0,
        0.25,
        0.0,
    )
    assert [s.token_share for s in pre.sources] == [1.0]
    # 160 of the 1,600 tokens are replayed pretraining text: 160 of the 960 post-training ones.
    assert (result.replay_tokens, result.post_training_tokens) == (160, 960)
    assert result.replay_token_share == pytest.approx(160 / 1600)
    assert result.post_training_replay_share == pytest.approx(160 / 960)


def test_plan_without_supervised_phases_has_no_replay(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"] = doc["phases"][:1]
    assert plan(validate_workflow(doc)).replay_token_share == 0.0


def test_carrying_optimizer_state_into_the_first_phase_is_refused(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][0]["optimizer_state"] = "carry"
    doc["phases"][1]["optimizer_state"] = "carry"
    found = problems_of(doc)
    assert list(found) == ["phases[0].optimizer_state"]
    assert "first phase has none" in found["phases[0].optimizer_state"]

    doc["phases"][0]["optimizer_state"] = "reset"
    assert validate_workflow(doc).phases[1].optimizer_state == "carry"
    doc["phases"][1]["optimizer_state"] = "keep"
    assert "phases[1].optimizer_state" in problems_of(doc)


def test_an_eval_set_is_named_after_its_task_unless_named(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["evals"].append(
        {"name": "qa-rag", "task": "qa_reasoning", "data": str(tmp_path / "b.jsonl")}
    )
    wf = validate_workflow(doc)
    assert [(e.name, e.task) for e in wf.evals] == [
        ("summarization", "summarization"),
        ("qa-rag", "qa_reasoning"),
    ]
    # The default name is left out of the canonical form: runs signed before eval sets had
    # names keep their signatures, and giving the default explicitly changes nothing.
    normalized = wf.normalized()["evals"]
    assert "name" not in normalized[0] and normalized[1]["name"] == "qa-rag"
    doc["evals"][0]["name"] = "summarization"
    assert validate_workflow(doc).normalized() == wf.normalized()
    assert validate_workflow(wf.normalized()).evals == wf.evals


def test_two_eval_sets_of_one_task_need_distinct_names(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    rag = {"task": "summarization", "data": str(tmp_path / "a.jsonl")}
    doc["evals"] += [rag, {**rag, "name": "summarization"}]
    found = problems_of(doc)
    assert list(found) == ["evals[1].name", "evals[2].name"]
    assert found["evals[1].name"].startswith(
        "duplicate eval set name 'summarization' (also evals[0])"
    )
    doc["evals"][1]["name"] = "sum-b"
    doc["evals"][2]["name"] = "sum-c"
    assert [e.name for e in validate_workflow(doc).evals] == ["summarization", "sum-b", "sum-c"]


def test_an_eval_set_name_is_bounded_like_its_column(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["evals"][0]["name"] = "x" * 201
    assert "evals[0].name" in problems_of(doc)
    doc["evals"][0]["name"] = "a\0b"
    assert "NUL" in problems_of(doc)["evals[0].name"]
    doc["evals"][0]["name"] = ""
    assert "evals[0].name" in problems_of(doc)


# --- replay phases --------------------------------------------------------------------------


def original_pr_workflow() -> dict[str, Any]:
    """The post-training workflow of the original PR in shape: five supervised phases at 2048
    positions, four interleaved continued_pretrain replay phases each at its pretraining
    stage's geometry, every microbatch 16,384 tokens, started from a pretrained model. The PR
    gives the totals; the per-phase steps and geometries are reconstructed to match them
    (docs/data.md, examples/workflows/sft.original.json)."""

    def phase(name: str, objective: str, steps: int, seq: int, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "objective": objective,
            "data": [{"path": f"/data/{name}.jsonl"}],
            "sequence_length": seq,
            "microbatch_size": 16384 // seq,
            "steps": steps,
            **extra,
        }

    def sft(name: str, objective: str, steps: int) -> dict[str, Any]:
        return phase(name, objective, steps, 2048, grad_accum=5)

    def replay(stage: int, seq: int) -> dict[str, Any]:
        return phase(
            f"replay_{stage}", "continued_pretrain", 220, seq, grad_accum=10, role="replay"
        )

    return {
        "name": "sft-original",
        "model": {"pretrained": "/models/step-249000"},
        "tokenizer": "/models/tokenizer.json",
        "microbatch_tokens": 16384,
        "phases": [
            sft("summarization", "summarization", 2000),
            replay(1, 512),
            sft("instruction", "instruction_tuning", 2400),
            replay(2, 1024),
            sft("qa_mixture", "qa_reasoning", 1800),
            replay(3, 2048),
            sft("qa_rag", "qa_reasoning", 1520),
            replay(4, 4096),
            sft("planning", "retrieval_planning", 800),
        ],
    }


def test_the_plan_of_the_original_pr_workflow_counts_its_replay_phases_as_replay() -> None:
    result = plan(validate_workflow(original_pr_workflow()))

    # By hand: a supervised step is 5 microbatches of 16,384 tokens = 81,920 tokens; a replay
    # step 10 microbatches = 163,840 tokens, whatever the replay phase's geometry.
    summarization = 2000 * 81_920  # 163,840,000
    instruction = 2400 * 81_920  # 196,608,000
    qa_mixture = 1800 * 81_920  # 147,456,000
    qa_rag = 1520 * 81_920  # 124,518,400
    planning = 800 * 81_920  # 65,536,000
    replay = 220 * 163_840  # 36,044,800, each of four
    assert [p.compute_tokens for p in result.phases] == [
        summarization, replay, instruction, replay, qa_mixture, replay, qa_rag, replay, planning,
    ]  # fmt: skip
    assert [p.role for p in result.phases] == ["train", "replay"] * 4 + ["train"]
    assert [p.replay_token_share for p in result.phases] == [0.0, 1.0] * 4 + [0.0]
    assert [s.sequence_length for p in result.phases[1::2] for s in p.sources] == [
        512, 1024, 2048, 4096,
    ]  # fmt: skip

    # The PR's figures: 9,400 steps, 842M compute tokens, replay 17.1% of them.
    total = summarization + instruction + qa_mixture + qa_rag + planning + 4 * replay
    assert (result.total_steps, result.compute_tokens, total) == (9400, 842_137_600, 842_137_600)
    assert result.replay_tokens == 4 * replay == 144_179_200
    assert result.replay_token_share == pytest.approx(144_179_200 / 842_137_600)
    assert f"{result.replay_token_share:.1%}" == "17.1%"
    # Every phase is post-training (no pretraining stage in the run): the two shares agree.
    assert result.post_training_tokens == total
    assert result.post_training_replay_share == result.replay_token_share


def test_replay_phases_and_replay_sources_count_alike_against_all_and_post_training_tokens(
    tmp_path: Path,
) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["data"][1] = replay_source(tmp_path)  # 160 of the sft phase's 640
    doc["phases"].append({**doc["phases"][0], "name": "replay", "role": "replay"})  # 640
    result = plan(validate_workflow(doc))
    pre, sft, replay = result.phases
    assert [p.compute_tokens for p in result.phases] == [640, 640, 640]
    assert (pre.replay_token_share, sft.replay_token_share, replay.replay_token_share) == (
        0.0,
        0.25,
        1.0,
    )
    # 160 + 640 tokens of replay; the pretraining stage is not post-training.
    assert (result.replay_tokens, result.post_training_tokens) == (800, 1280)
    assert result.replay_token_share == pytest.approx(800 / 1920)
    assert result.post_training_replay_share == pytest.approx(800 / 1280)


def test_role_replay_is_refused_on_a_supervised_phase_at_its_path(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["role"] = "replay"
    found = problems_of(doc)
    assert list(found) == ["phases[1].role"]
    assert "for a continued_pretrain phase" in found["phases[1].role"]
    assert "objective is summarization" in found["phases[1].role"]

    doc["phases"][1]["role"] = "train"
    doc["phases"][0]["role"] = "warmup"
    found = problems_of(doc)
    assert list(found) == ["phases[0].role"]
    assert "'train' or 'replay'" in found["phases[0].role"]

    doc["phases"][0]["role"] = "replay"
    assert [p.role for p in validate_workflow(doc).phases] == ["replay", "train"]


def test_a_plan_stored_before_replay_phases_reads_with_its_totals_recomputed(
    tmp_path: Path,
) -> None:
    doc = make_workflow(tmp_path)
    doc["phases"][1]["data"][1] = replay_source(tmp_path)
    current = plan(validate_workflow(doc))
    # What runs.plan held before: no roles, no counts, replay as a share of supervised tokens.
    stored = current.model_dump(
        mode="json", exclude={"replay_tokens", "post_training_tokens", "post_training_replay_share"}
    )
    stored["replay_token_share"] = 160 / 640
    for phase in stored["phases"]:
        del phase["role"]
    assert Plan.model_validate(stored) == current


def test_grad_accum_must_divide_over_the_phase_s_devices(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path, resources={"devices": 2})
    # phases[0] has grad_accum 1 (the default) over the workflow's 2 devices; phases[1] has 2.
    problems = problems_of(doc)
    assert set(problems) == {"phases[0].grad_accum"}
    assert "1 microbatches a step do not divide over 2 devices" in problems["phases[0].grad_accum"]
    doc["phases"][0]["resources"] = {"devices": 1}
    doc["phases"][1]["resources"] = {"devices": 4}
    assert set(problems_of(doc)) == {"phases[1].grad_accum"}
    doc["phases"][1]["grad_accum"] = 4
    validate_workflow_with_files(doc)
    doc["phases"][1]["resources"] = {"devices": 65}
    assert set(problems_of(doc)) == {"phases[1].resources.devices"}


def test_resource_queues_route_a_phase_only_to_workers_big_enough() -> None:
    from contracts.dispatch import devices_queue, served_queues

    assert devices_queue("trainctl", 1) == "trainctl"
    assert devices_queue("trainctl", 4) == "trainctl.devices-4"
    assert served_queues("trainctl", 1) == ["trainctl"]
    assert served_queues("gpu", 3) == ["gpu", "gpu.devices-2", "gpu.devices-3"]
    assert devices_queue("gpu", 4) not in served_queues("gpu", 3)


def test_keep_best_names_eval_sets_of_the_workflow_each_once(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path, checkpoint={"keep_best": ["summarization"]})
    assert validate_workflow(doc).checkpoint.keep_best == ["summarization"]

    doc["checkpoint"]["keep_best"] = ["summarization", "qa", "summarization"]
    found = problems_of(doc)
    assert list(found) == ["checkpoint.keep_best[1]", "checkpoint.keep_best[2]"]
    assert "'qa' is not an eval set of this workflow" in found["checkpoint.keep_best[1]"]
    assert "'summarization'" in found["checkpoint.keep_best[1]"]  # the sets it has
    assert "named twice (also keep_best[0])" in found["checkpoint.keep_best[2]"]


def test_an_empty_path_is_one_problem_saying_it_is_empty(tmp_path: Path) -> None:
    doc = make_workflow(tmp_path, tokenizer="")
    doc["phases"][0]["data"][0]["path"] = ""
    problems = problems_of(doc)
    assert problems["tokenizer"] == EMPTY_PATH
    assert problems["phases[0].data[0].path"] == EMPTY_PATH
