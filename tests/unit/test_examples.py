"""The shipped examples: workflows that validate, corpora that their script regenerates exactly,
a post-training example that replays pretraining text in every supervised phase, a RAG corpus
that asks its question first, and the original PR's workflow with what of it is the PR's and
what is reconstructed, whose small twin `trainctl demo` starts from the demo's checkpoint."""

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
    every phase starts fresh optimizers, trainctl's default: the PR does not say (docs/data.md
    measures carry too)."""
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


def test_sft_original_reconstructs_a_workflow_with_the_pr_totals() -> None:
    workflow = load(ORIGINAL)
    assert_original_shape(workflow)
    assert [e.name for e in workflow.evals] == ORIGINAL_SETS
    assert workflow.microbatch_tokens == 16_384
    supervised, replay = workflow.phases[0::2], workflow.phases[1::2]
    assert {(p.sequence_length, p.microbatch_size, p.grad_accum) for p in supervised} == {
        (2048, 8, 5)
    }
    # Each replay phase at a pretraining stage's geometry, as the PR says; the stages are
    # reconstructed, doubling the sequence length.
    assert [(p.sequence_length, p.microbatch_size) for p in replay] == [
        (512, 32), (1024, 16), (2048, 8), (4096, 4),
    ]  # fmt: skip
    assert {s.path.endswith("pretrain.replay.txt.zst") for p in replay for s in p.sources()} == {
        True
    }

    # Reconstructed step counts that give the PR's figures (9,400 steps, 842M compute tokens,
    # 17.1% replay) exactly, as docs/data.md shows them.
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


# What the PR says of its workflow, in its own words (docs/data.md quotes them in its table):
# "a validated 9-phase post-training workflow", "four interleaved continued_pretrain phases
# (17.1% of tokens)", "842M compute tokens, 9,400 steps, every microbatch exactly 16,384
# tokens", the pre-SFT baseline "summarization ppl 22.5, instruction 12.3, qa-mixture 39.4,
# qa-rag 111.9, planning 49.7" on "step-249000", "the 300M SFT run", "at sequence_length 2048"
# (RAG) and "abort-free at 2048" (instruction), "(202k summarization pairs, 307k
# instruction/QA mixture, 126k RAG-task records)", replay "at each pretraining stage's own
# geometry". Nothing else: every other row of the table is reconstructed.
PR_GIVES = {
    "phases": "9, four of them replay",
    "steps": "9,400",
    "compute tokens": "842M",
    "replay share of the tokens": "17.1%",
    "tokens per microbatch": "16,384",
    "eval sets": "summarization, instruction, qa-mixture, qa-rag, planning",
    "supervised sequence_length": "2048 for the instruction and RAG data",
    "model and start": "a 300M model, from its checkpoint step-249000",
    "pre-SFT perplexity": "22.5, 12.3, 39.4, 111.9, 49.7",
    "data": "202k summarization pairs, 307k instruction/QA mixture, 126k RAG-task records",
}
RECONSTRUCTED = {
    "steps per phase",
    "order of the phases",
    "supervised geometry",
    "replay geometry",
    "schedules",
    "learning rates",
    "optimizers at a phase boundary",
    "model config",
    "evals, checkpoints, seed",
}


def docs_table(heading: str, first_header: str) -> dict[str, list[str]]:
    """The first markdown table after `heading` in docs/data.md whose header row starts with
    `first_header`, as {first cell: the other cells}."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    lines = text[text.index(heading) :].splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header}"))
    rows = {}
    for line in lines[top + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def one(values: set[str]) -> str:
    assert len(values) == 1, values
    return values.pop()


def what_sft_original_has(workflow: Workflow) -> dict[str, str]:
    """The right column of docs/data.md's table, rendered from the workflow and its plan."""
    the_plan = plan(workflow)
    supervised = [p for p in workflow.phases if p.role == "train"]
    replay = [p for p in workflow.phases if p.role == "replay"]
    config = workflow.model.config or {}
    names = [e.name for e in workflow.evals]
    return {
        "phases": f"{len(workflow.phases)}: {len(supervised)} supervised, {len(replay)} replay",
        "steps": f"{the_plan.total_steps:,}",
        "compute tokens": f"{the_plan.compute_tokens:,}",
        "replay share of the tokens": f"{the_plan.replay_token_share:.1%}",
        "tokens per microbatch": f"{workflow.microbatch_tokens:,}",
        "eval sets": "the same five" if names == ORIGINAL_SETS else ", ".join(names),
        "supervised sequence_length": one(
            {f"{p.sequence_length} in every supervised phase" for p in supervised}
        ),
        # The workflow names no start: a run is given one (`--initial-checkpoint`).
        "model and start": "the start is given when a run is created"
        if workflow.model.pretrained is None
        else str(workflow.model.pretrained),
        "pre-SFT perplexity": "not measured here",
        "data": one(
            {
                "the example corpora" if Path(s.path).parent == EXAMPLES / "data" else s.path
                for p in workflow.phases
                for s in p.sources()
            }
        ),
        "steps per phase": ", ".join(str(p.steps) for p in workflow.phases),
        "order of the phases": ", ".join(p.name for p in workflow.phases),
        "supervised geometry": one(
            {
                f"{p.sequence_length}x{p.microbatch_size}, {p.grad_accum} microbatches a step"
                for p in supervised
            }
        ),
        "replay geometry": ", ".join(f"{p.sequence_length}x{p.microbatch_size}" for p in replay)
        + one({f", {p.grad_accum} microbatches a step" for p in replay}),
        "schedules": one(
            {f"{p.schedule.kind}, {p.schedule.warmup_steps} warm-up steps" for p in supervised}
        )
        + one(
            {
                f"; replay {p.schedule.kind}, {p.schedule.warmup_steps} warm-up steps, "
                f"{p.schedule.decay_fraction:.0%} decay"
                for p in replay
            }
        ),
        "learning rates": f"Muon {workflow.optimizer.muon_lr}, AdamW {workflow.optimizer.adamw_lr}"
        + one({f", lr_scale {p.lr_scale} in every phase" for p in workflow.phases}),
        "optimizers at a phase boundary": one(
            {f"{p.optimizer_state} in every phase (trainctl's default)" for p in workflow.phases}
        ),
        "model config": f"{config['num_hidden_layers']}-layer {config['model_type']}, hidden "
        f"{config['hidden_size']}, vocabulary {config['vocab_size']}",
        "evals, checkpoints, seed": one(
            {f"evals every {e.every_steps} steps" for e in workflow.evals}
        )
        + f"; a checkpoint every {workflow.checkpoint.every_steps}, "
        f"{workflow.checkpoint.keep_last} kept; seed {workflow.seed}",
    }


def test_docs_say_which_numbers_of_sft_original_the_pr_gives_and_which_are_reconstructed() -> None:
    table = docs_table("### The original PR's workflow", "| the PR |")
    assert set(table) == set(PR_GIVES) | RECONSTRUCTED
    has = what_sft_original_has(load(ORIGINAL))
    for row, (the_pr, the_workflow) in table.items():
        assert the_workflow == has[row], f"docs/data.md, row {row!r}"
        if row in PR_GIVES:
            assert the_pr == PR_GIVES[row], f"docs/data.md, row {row!r}: not the PR's words"
        else:
            assert the_pr.startswith("not given"), f"docs/data.md, row {row!r}: reconstructed"
    # The PR's figures are the plan's, to the digits the PR gave.
    the_plan = plan(load(ORIGINAL))
    assert PR_GIVES["steps"] == f"{the_plan.total_steps:,}"
    assert PR_GIVES["compute tokens"] == f"{round(the_plan.compute_tokens / 1e6)}M"
    assert PR_GIVES["replay share of the tokens"] == f"{the_plan.replay_token_share:.1%}"
    assert PR_GIVES["tokens per microbatch"] == f"{load(ORIGINAL).microbatch_tokens:,}"


def test_the_workflows_folder_says_what_each_example_is_and_what_of_the_original_is_the_prs() -> (
    None
):
    text = (EXAMPLES / "workflows" / "README.md").read_text()
    described = {line.split("`")[1] for line in text.splitlines() if line.startswith("- `")}
    assert described == {p.name for p in WORKFLOWS}
    original = text[text.index("- `sft.original.json`") :].split("\n- ")[0]
    workflow = load(ORIGINAL)
    the_plan = plan(workflow)
    # The PR's figures (PR_GIVES), as the plan computes them.
    for figure in (
        f"{len(workflow.phases)} phases, four of them replay",
        f"{the_plan.total_steps:,} steps",
        f"{round(the_plan.compute_tokens / 1e6)}M compute tokens",
        f"{100 * the_plan.replay_token_share:.1f} % replay",
        f"{workflow.microbatch_tokens:,}-token microbatches",
    ):
        assert figure in original, figure
    assert "Everything else is reconstructed" in original
