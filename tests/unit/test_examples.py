"""The shipped examples: workflows that validate, corpora that their script regenerates exactly,
and a post-training example that replays pretraining text in every supervised phase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from typer.testing import CliRunner

from cli.common import load_workflow
from cli.demo import fits_start, needs_start
from cli.launcher import DEMO_WORKFLOW as DEMO
from cli.main import app
from contracts.jobs import InspectionReport, InspectRequest
from contracts.workflow import OBJECTIVES, Workflow, plan
from runtime.path import resolve_paths, validate_workflow_with_files
from worker.data.inspect import inspect_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKFLOWS = sorted((EXAMPLES / "workflows").glob("*.json"))
TOKENIZER = EXAMPLES / "tokenizer" / "tokenizer.json"
runner = CliRunner()


def load(path: Path) -> Workflow:
    return validate_workflow_with_files(resolve_paths(json.loads(path.read_text()), path.parent))


def shipped_bytes(path: Path) -> bytes:
    """A file's content; a .zst file's decompressed, since another zstd version may compress
    the same text to other bytes."""
    if path.suffix == ".zst":
        with path.open("rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as reader:
            return reader.read()
    return path.read_bytes()


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_every_example_workflow_validates(path: Path) -> None:
    workflow = load(path)
    tasks = {e.task for e in workflow.evals}
    if path.name == "sft.original.json":
        # The PR's baseline: its five sets, every supervised task, no pretraining set.
        assert tasks == set(OBJECTIVES) - {"continued_pretrain"}
    else:
        assert tasks == set(OBJECTIVES)


def test_make_examples_regenerates_the_shipped_files_exactly(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_examples.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for folder in ("data", "tokenizer"):
        made = sorted(p.name for p in (tmp_path / folder).iterdir())
        shipped = sorted(p.name for p in (EXAMPLES / folder).iterdir())
        assert made == shipped, f"examples/{folder} differs from what make_examples.py writes"
        for name in made:
            assert shipped_bytes(tmp_path / folder / name) == shipped_bytes(
                EXAMPLES / folder / name
            ), f"examples/{folder}/{name} is not what make_examples.py writes"


def test_sft_example_replays_pretraining_text_in_every_supervised_phase() -> None:
    workflow = load(EXAMPLES / "workflows" / "sft.example.json")
    pretrain = workflow.phases[0]
    assert pretrain.objective == "continued_pretrain"
    the_plan = plan(workflow)
    assert 0.2 <= the_plan.post_training_replay_share <= 0.3
    assert the_plan.total_steps <= 300  # minutes on 2 CPU cores
    supervised = [p for p in workflow.phases if p.objective != "continued_pretrain"]
    assert {p.objective for p in supervised} == set(OBJECTIVES) - {"continued_pretrain"}
    for phase, phase_plan in zip(workflow.phases, the_plan.phases, strict=True):
        if phase.objective == "continued_pretrain":
            continue
        replay = [s for s in phase.sources() if s.objective == "continued_pretrain"]
        assert replay, f"phase {phase.name} has no replay source"
        for source in replay:
            # The pretraining geometry, so replay loss compares with the pretraining loss.
            assert (source.sequence_length, source.microbatch_size) == (
                pretrain.sequence_length,
                pretrain.microbatch_size,
            )
        assert 0.2 <= phase_plan.replay_token_share <= 0.3
        assert phase.microbatch_tokens == workflow.microbatch_tokens


def test_rag_corpus_trims_passages_but_never_the_question() -> None:
    """At the QA phase's sequence_length a fair share of training records lose passages, all of
    them still fit (training would refuse any that did not), the phase's inspection gate passes,
    and the eval file has records too long even without passages."""
    workflow = load(EXAMPLES / "workflows" / "sft.example.json")
    qa = next(p for p in workflow.phases if p.objective == "qa_reasoning")
    source = next(s for s in qa.sources() if s.objective == "qa_reasoning")
    assert qa.inspection is not None

    def inspect_at(path: str) -> InspectionReport:
        return inspect_file(
            InspectRequest(
                path=path,
                tokenizer=str(TOKENIZER),
                objective="qa_reasoning",
                sequence_length=source.sequence_length,
            )
        )

    train = inspect_at(source.path)
    assert train.formats == {"segmented": train.records}
    assert train.fit == train.records
    assert 0.2 <= train.trimmed / train.records <= 0.4
    assert train.gate_failures(qa.inspection) == []

    evaluation = next(e for e in workflow.evals if e.task == "qa_reasoning")
    assert evaluation.sequence_length == source.sequence_length
    held_out = inspect_at(evaluation.data)
    assert 1 <= held_out.refused <= 5
    assert held_out.zero_target == 0


def test_rag_corpus_asks_its_question_before_the_passages() -> None:
    """As the PR's regenerated RAG data: the question first, then the passages, then the cue to
    answer. Only passages are elastic, and cutting the prompt from its tail, as the PR's encoder
    did, would reach the passages long before the question."""
    for split in ("train", "eval"):
        path = EXAMPLES / "data" / f"qa_rag.{split}.jsonl"
        for line, text in enumerate(path.read_text().splitlines(), start=1):
            roles = [(s["role"], s.get("elastic")) for s in json.loads(text)["segments"]]
            where = f"{path.name}:{line}"
            assert roles[0] == ("question", None), where
            assert roles[-1] == ("cue", None), where
            assert {role for role, _ in roles[1:-1]} == {"passage"}, where
            assert all(elastic is not None for _, elastic in roles[1:-1]), where


def test_chat_corpus_fits_the_instruction_phase_whole() -> None:
    report = inspect_file(
        InspectRequest(
            path=str(EXAMPLES / "data" / "chat.train.jsonl"),
            tokenizer=str(TOKENIZER),
            objective="instruction_tuning",
            sequence_length=64,
        )
    )
    assert report.formats == {"chat": report.records}
    assert report.fit == report.records


ORIGINAL = EXAMPLES / "workflows" / "sft.original.json"
ORIGINAL_SMALL = EXAMPLES / "workflows" / "sft.original.small.json"
ORIGINAL_SETS = ["summarization", "instruction", "qa-mixture", "qa-rag", "planning"]


def assert_original_shape(workflow: Workflow) -> None:
    """Five supervised phases, each but the last followed by a replay phase of pretraining text;
    as the PR wrote it, every phase starts fresh optimizers (docs/data.md measures carry too)."""
    assert [p.objective for p in workflow.phases] == [
        "summarization", "continued_pretrain", "instruction_tuning", "continued_pretrain",
        "qa_reasoning", "continued_pretrain", "qa_reasoning", "continued_pretrain",
        "retrieval_planning",
    ]  # fmt: skip
    assert [p.role for p in workflow.phases] == ["train", "replay"] * 4 + ["train"]
    assert [p.optimizer_state for p in workflow.phases] == ["reset"] * 9
    assert all(p.microbatch_tokens == workflow.microbatch_tokens for p in workflow.phases)
    named = {e.name: e.task for e in workflow.evals}
    assert [name for name in named if name in ORIGINAL_SETS] == ORIGINAL_SETS
    assert named["qa-mixture"] == named["qa-rag"] == "qa_reasoning"
    assert len({e.data for e in workflow.evals}) == len(workflow.evals)


def test_sft_original_is_the_pr_workflow_at_its_own_geometry() -> None:
    workflow = load(ORIGINAL)
    assert_original_shape(workflow)
    assert [e.name for e in workflow.evals] == ORIGINAL_SETS
    assert workflow.microbatch_tokens == 16_384
    supervised, replay = workflow.phases[0::2], workflow.phases[1::2]
    assert {(p.sequence_length, p.microbatch_size, p.grad_accum) for p in supervised} == {
        (2048, 8, 5)
    }
    # Each replay phase at its pretraining stage's geometry.
    assert [(p.sequence_length, p.microbatch_size) for p in replay] == [
        (512, 32), (1024, 16), (2048, 8), (4096, 4),
    ]  # fmt: skip
    assert {s.path.endswith("pretrain.replay.txt.zst") for p in replay for s in p.sources()} == {
        True
    }

    # The PR's figures, as docs/data.md shows them.
    the_plan = plan(workflow)
    assert [p.steps for p in workflow.phases] == [2000, 220, 2400, 220, 1800, 220, 1520, 220, 800]
    assert (the_plan.total_steps, the_plan.compute_tokens) == (9400, 842_137_600)
    assert the_plan.replay_tokens == 4 * 220 * 10 * 16_384 == 144_179_200
    assert the_plan.replay_token_share == pytest.approx(144_179_200 / 842_137_600)
    assert f"{the_plan.replay_token_share:.1%}" == "17.1%"
    assert the_plan.post_training_tokens == the_plan.compute_tokens
    assert the_plan.post_training_replay_share == the_plan.replay_token_share


def test_sft_original_small_is_its_twin_from_the_demo_checkpoint() -> None:
    workflow, original = load(ORIGINAL_SMALL), load(ORIGINAL)
    assert_original_shape(workflow)
    # Plus the held-out pretraining set that measures forgetting.
    assert {e.name: e.task for e in workflow.evals}["pretrain"] == "continued_pretrain"
    demo = load(EXAMPLES / "workflows" / "demo.json")
    # Starts from a checkpoint of the demo run: the same model, tokenizer and envelope.
    assert workflow.model == demo.model
    assert workflow.tokenizer == demo.tokenizer
    assert workflow.microbatch_tokens == demo.microbatch_tokens
    replay = workflow.phases[1::2]
    assert [p.sequence_length for p in replay] == sorted(p.sequence_length for p in replay)
    assert (replay[-1].sequence_length, replay[-1].microbatch_size) == (
        demo.phases[0].sequence_length,
        demo.phases[0].microbatch_size,
    )
    the_plan = plan(workflow)
    assert the_plan.total_steps <= 300  # well under two minutes on 2 CPU cores
    # The same replay share as the original, to the digit the PR gave.
    assert f"{the_plan.replay_token_share:.1%}" == f"{plan(original).replay_token_share:.1%}"


def test_demo_starts_the_post_training_examples_from_the_demo_checkpoint() -> None:
    """`trainctl demo --workflow` starts a workflow that does not pretrain first from the demo
    run's final checkpoint; one that pretrains, from its own start."""
    demo = load_workflow(DEMO)
    starts = {p.name: needs_start(load_workflow(p)) for p in WORKFLOWS}
    assert starts == {
        "demo.json": False,
        "sft.example.json": False,
        "sft.original.json": True,
        "sft.original.mixture.small.json": True,
        "sft.original.small.json": True,
    }
    assert fits_start(load_workflow(ORIGINAL_SMALL), demo)
    assert fits_start(
        load_workflow(EXAMPLES / "workflows" / "sft.original.mixture.small.json"), demo
    )
    assert not fits_start(load_workflow(ORIGINAL), demo)


def test_demo_refuses_a_post_training_workflow_the_demo_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sft.original.json needs a checkpoint of its own 24-layer model: refused before any stack
    starts, saying what to run instead."""
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINCTL_HOME", str(home))
    result = runner.invoke(app, ["demo", "--workflow", str(ORIGINAL)])
    assert result.exit_code == 2, result.output
    assert "--initial-checkpoint" in result.output
    assert not home.exists()


def test_sft_original_mixture_small_replays_the_same_share_as_sources() -> None:
    """The comparison docs/data.md measures: the twin's supervised phases and tokens, its replay
    as a source of every supervised phase at the demo's pretraining geometry instead."""
    twin = load(ORIGINAL_SMALL)
    mixture = load(EXAMPLES / "workflows" / "sft.original.mixture.small.json")
    twin_plan, mixture_plan = plan(twin), plan(mixture)
    assert all(p.role == "train" for p in mixture.phases)
    assert [p.objective for p in mixture.phases] == [p.objective for p in twin.phases[0::2]]
    assert mixture.evals == twin.evals
    assert mixture_plan.total_steps == twin_plan.total_steps
    assert mixture_plan.compute_tokens == twin_plan.compute_tokens
    assert mixture_plan.replay_token_share == pytest.approx(twin_plan.replay_token_share, abs=1e-3)
    for phase in mixture.phases:
        replay = [s for s in phase.sources() if s.objective == "continued_pretrain"]
        assert [(s.sequence_length, s.microbatch_size) for s in replay] == [(128, 4)]
