"""The local tools of the CLI: `data inspect`, `eval` and the plan of `workflow validate`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.demo import demo_problems
from cli.main import app

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "tokenizer" / "tokenizer.json"
runner = CliRunner()

SHORT = {"source": "the cat", "target": " sat"}
LONG = {"source": "the cat sat under the dog " * 20, "target": " flew"}
EMPTY = {"source": "the cat", "target": ""}


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def inspect_args(
    path: Path, *extra: str, objective: str = "qa_reasoning", sequence_length: int = 32
) -> list[str]:
    return [
        "data",
        "inspect",
        str(path),
        "--tokenizer",
        str(TOKENIZER),
        "--objective",
        objective,
        "--sequence-length",
        str(sequence_length),
        *extra,
    ]


@pytest.fixture(autouse=True)
def home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The local tools keep token stores under the embedded service's artifact store: a home
    of the test's own, not the machine's ~/.trainctl."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("TRAINCTL_HOME", str(home))
    monkeypatch.delenv("TRAINCTL_ARTIFACT_ROOT", raising=False)
    return home


def test_inspect_reports_what_training_would_refuse_and_exits_1(tmp_path: Path, home: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", [SHORT, LONG, SHORT, EMPTY])
    result = runner.invoke(app, inspect_args(path, "--json"))
    assert result.exit_code == 1, result.output
    # The store it read is the one a run on the embedded stack maps (fit to 32 positions).
    stores = [meta.parent.name for meta in (home / "artifacts" / "tokens").glob("*/meta.json")]
    assert [name.rsplit("-", 1)[1] for name in stores] == ["fit32"]
    report = json.loads(result.stdout)
    assert (report["records"], report["fit"], report["refused"]) == (4, 2, 1)
    assert (report["zero_target"], report["duplicates"]) == (1, 1)
    assert report["source_end_lost_if_truncated"] == 1
    assert {p["line"] for p in report["problems"]} == {2, 3, 4}


def test_write_fit_writes_the_records_that_fit_and_says_what_it_left(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", [SHORT, LONG, EMPTY, {**SHORT, "id": 7}])
    out = tmp_path / "fit" / "qa.fit.jsonl"
    result = runner.invoke(
        app, [*inspect_args(path, "--write-fit", str(out))], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    lines = path.read_text().splitlines()
    assert out.read_text().splitlines() == [lines[0], lines[3]]  # the original lines, in order
    assert "wrote 2 records" in result.stdout and "left out 2" in result.stdout
    # The written file passes: nothing in it would be refused.
    again = runner.invoke(app, inspect_args(out, "--json"))
    assert again.exit_code == 0 and json.loads(again.stdout)["refused"] == 0


def test_inspect_counts_what_an_eval_set_would_skip_and_marks_more_than_a_few_percent(
    tmp_path: Path,
) -> None:
    path = tmp_path / "qa.eval.jsonl"
    lines = [json.dumps(SHORT), "{not json", json.dumps({"text": "the cat"}), json.dumps(LONG)]
    path.write_text("".join(line + "\n" for line in [*lines, *[json.dumps(SHORT)] * 6]))
    result = runner.invoke(app, inspect_args(path), env={"COLUMNS": "200"})
    # Training would refuse the file: exit 1, and the lines named.
    assert result.exit_code == 1, result.output
    said = result.stdout.splitlines()
    assert (
        "as an eval set: 7 records scored, 3 skipped (1 too long, 1 malformed JSON, 1 wrong "
        "shape) !" in said
    )
    assert "!: more than 2% of the set's records skipped" in said
    assert "line 2: not valid JSON" in result.stderr
    assert "line 3: a text record where qa_reasoning reads supervised records" in result.stderr
    report = json.loads(runner.invoke(app, inspect_args(path, "--json")).stdout)
    assert report["skipped_records"] == {"malformed_json": 1, "wrong_shape": 1}
    assert (report["records"], report["fit"], report["oversized_records"]) == (10, 7, 1)

    clean = write_jsonl(tmp_path / "clean.jsonl", [SHORT] * 3)
    result = runner.invoke(app, inspect_args(clean), env={"COLUMNS": "200"})
    assert "as an eval set: 3 records scored, 0 skipped" in result.stdout.splitlines()


def tiny_model(directory: Path) -> Path:
    """An untrained save_pretrained Llama with the example tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    shutil.copy(TOKENIZER, directory / "tokenizer.json")
    return directory


def test_eval_of_a_checkpoint_outside_a_run(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "qa.jsonl", [SHORT, LONG, {"source": "a dog", "target": " ran"}])
    args = ["eval", str(model_dir), "--task", "qa_reasoning", "--data", str(data)]

    result = runner.invoke(app, [*args, "--sequence-length", "32", "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert (answer["records"], answer["oversized_records"], answer["step"]) == (2, 1, 0)
    assert answer["skipped_records"] == {}
    assert [e.split(": ", 1)[0] for e in answer["skipped_examples"]] == [f"{data}:2"]
    # An untrained model over 512 tokens: perplexity near the vocabulary size.
    assert 200 < answer["perplexity"] < 1500
    small = runner.invoke(app, [*args, "--sequence-length", "32", "--batch-size", "1", "--json"])
    assert json.loads(small.stdout)["cross_entropy"] == pytest.approx(answer["cross_entropy"])

    said = runner.invoke(app, [*args, "--sequence-length", "32"], env={"COLUMNS": "200"})
    assert said.exit_code == 0, said.output
    first, *notes = said.stdout.splitlines()
    assert "of 2 records (skipped: 1 too long); checkpoint step 0" in first
    assert notes[:2] == [
        "!: more than 2% of the set's records skipped",
        "qa_reasoning, the first skipped:",
    ]
    assert notes[2].startswith(f"  {data}:2: encodes to")

    missing = runner.invoke(
        app,
        [
            "eval",
            str(tmp_path),
            "--task",
            "qa_reasoning",
            "--data",
            str(data),
            "--sequence-length",
            "32",
        ],
    )
    assert missing.exit_code == 2 and "no config.json" in missing.stderr


def test_eval_of_every_set_of_a_workflow_prints_one_row_per_set(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path / "model")
    dog = {"source": "a dog", "target": " ran"}
    short = write_jsonl(tmp_path / "qa.jsonl", [SHORT, LONG, dog])
    middle = {"source": "the cat sat under the dog " * 4, "target": " flew"}  # fits 128, not 32
    write_jsonl(tmp_path / "rag.jsonl", [SHORT, middle, LONG])
    doc = json.loads((ROOT / "examples" / "workflows" / "demo.json").read_text())
    doc["tokenizer"] = str(TOKENIZER)
    doc["evals"] = [  # two sets of one task, each at its own geometry
        {"name": "qa_short", "task": "qa_reasoning", "data": str(short), "sequence_length": 32},
        {"task": "qa_reasoning", "data": "rag.jsonl", "batch_size": 1},  # at the longest, 128
    ]
    workflow = tmp_path / "workflow.json"
    workflow.write_text(json.dumps(doc))
    args = ["eval", str(model_dir), "--workflow", str(workflow)]

    answer = runner.invoke(app, [*args, "--json"])
    assert answer.exit_code == 0, answer.output
    results = json.loads(answer.stdout)
    rows = [(r["name"], r["task"], r["records"], r["oversized_records"]) for r in results]
    assert rows == [("qa_short", "qa_reasoning", 2, 1), ("qa_reasoning", "qa_reasoning", 2, 1)]
    # The set's number is the one `eval --data` gives at the same geometry.
    single = ["eval", str(model_dir), "--task", "qa_reasoning", "--data", str(short)]
    alone = runner.invoke(app, [*single, "--sequence-length", "32", "--json"])
    assert json.loads(alone.stdout)["cross_entropy"] == pytest.approx(results[0]["cross_entropy"])

    table = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0] == f"{model_dir} (step 0):"
    assert lines[1].split() == ["set", "task", "scored", "skipped", "cross-entropy", "perplexity"]
    # One of three records skipped in each set: marked, and said why below the table.
    for line, r in zip(lines[2:4], results, strict=True):
        expected = [r["name"], r["task"], str(r["records"]), str(r["oversized_records"]), "!"]
        assert line.split() == [*expected, f"{r['cross_entropy']:.4f}", f"{r['perplexity']:.2f}"]
    assert lines[4] == "!: more than 2% of the set's records skipped"
    assert lines[5] == "qa_short skipped 1 too long, the first:"
    assert lines[6].startswith(f"  {short}:2: encodes to")
    assert lines[7] == "qa_reasoning skipped 1 too long, the first:"

    (tmp_path / "rag.jsonl").unlink()
    gone = runner.invoke(app, args)
    assert gone.exit_code == 2
    assert f"eval set 'qa_reasoning': {tmp_path / 'rag.jsonl'}: file not found" in " ".join(
        gone.stderr.split()
    )
    both = runner.invoke(app, [*args, "--task", "qa_reasoning"])
    assert both.exit_code == 2 and "leave out --task" in both.stderr
    neither = runner.invoke(app, ["eval", str(model_dir)])
    assert neither.exit_code == 2 and "--workflow" in neither.stderr


def test_validate_prints_the_plan_with_sources_and_replay_share(tmp_path: Path) -> None:
    from runtime.path import resolve_paths

    workflows = ROOT / "examples" / "workflows"
    doc = resolve_paths(json.loads((workflows / "demo.json").read_text()), workflows)
    sft = doc["phases"][1]
    sft["data"].append(
        {
            "name": "replay",
            "path": str(ROOT / "examples" / "data" / "pretrain.train.jsonl"),
            "weight": 1 / 3,
            "objective": "continued_pretrain",
            "sequence_length": 128,
            "microbatch_size": 4,
        }
    )
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(doc))
    result = runner.invoke(app, ["workflow", "validate", str(path), "--json"])
    table = runner.invoke(app, ["workflow", "validate", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    phase = plan["phases"][1]
    assert [s["name"] for s in phase["sources"]] == ["summarization", "replay"]
    assert phase["replay_token_share"] == pytest.approx(0.25)
    # A quarter of the 25 steps of one of the four 25-step supervised phases, after 75 steps
    # of pretraining: 1/28 of all tokens, 1/16 of the post-training ones.
    assert plan["replay_token_share"] == pytest.approx(0.25 * 25 / 175)
    assert plan["post_training_replay_share"] == pytest.approx(0.25 * 25 / 100)
    assert "replay" in table.stdout and "128x4" in table.stdout and "25.0%" in table.stdout


def test_validate_prints_replay_phases_and_both_replay_shares_within_80_columns(
    tmp_path: Path,
) -> None:
    from runtime.path import resolve_paths

    workflows = ROOT / "examples" / "workflows"
    doc = resolve_paths(json.loads((workflows / "demo.json").read_text()), workflows)
    pretrain, *supervised = doc["phases"]
    # Each supervised phase followed by a 10-step replay of the pretraining text at 256x2.
    replay = {**pretrain, "role": "replay", "steps": 10, "schedule": {"warmup_steps": 0}}
    replay.update(sequence_length=256, microbatch_size=2)
    doc["phases"] = [pretrain]
    for i, phase in enumerate(supervised):
        doc["phases"] += [phase, {**replay, "name": f"replay_{i}"}]
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(doc))
    result = runner.invoke(app, ["workflow", "validate", str(path), "--json"])
    table = runner.invoke(app, ["workflow", "validate", str(path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and table.exit_code == 0, result.output + table.output

    # By hand, in 512-token steps: 75 pretraining, 4 x 25 supervised, 4 x 10 replay.
    plan = json.loads(result.stdout)
    assert [p["role"] for p in plan["phases"]] == ["train"] + ["train", "replay"] * 4
    assert (plan["compute_tokens"], plan["replay_tokens"]) == (215 * 512, 40 * 512)
    assert plan["post_training_tokens"] == 140 * 512
    assert plan["replay_token_share"] == pytest.approx(40 / 215)
    assert plan["post_training_replay_share"] == pytest.approx(40 / 140)
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    replay_rows = [line for line in lines if "(replay)" in line]
    assert len(replay_rows) == 4 and all("256x2" in r and "100.0%" in r for r in replay_rows)
    assert "replay 20,480 tokens: 18.6% of all tokens, 28.6% of 71,680 post-training" in (
        " ".join(lines)
    )

    doc["phases"][1]["role"] = "replay"  # a supervised phase
    path.write_text(json.dumps(doc))
    refused = runner.invoke(app, ["workflow", "validate", str(path)])
    assert refused.exit_code == 2
    assert 'phases[1].role: "replay" is for a continued_pretrain phase' in refused.stderr


def test_validate_checks_the_files_relative_to_the_workflow_file(tmp_path: Path) -> None:
    doc = json.loads((ROOT / "examples" / "workflows" / "demo.json").read_text())
    doc["tokenizer"] = str(TOKENIZER)
    doc["phases"][0]["data"] = [{"path": "gone.jsonl"}]
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(doc))
    result = runner.invoke(app, ["workflow", "validate", str(path)])
    assert result.exit_code == 2
    # Compared without whitespace: the console wraps long lines at its width.
    expected = f"phases[0].data[0].path: file {tmp_path / 'gone.jsonl'} not found"
    assert "".join(expected.split()) in "".join(result.stderr.split())


def test_write_fit_to_a_zst_name_writes_zstd_that_reads_back(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", [SHORT, LONG, {**SHORT, "id": 2}])
    out = tmp_path / "qa.fit.jsonl.zst"
    result = runner.invoke(app, inspect_args(path, "--write-fit", str(out)))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # the zstd frame magic
    again = runner.invoke(app, inspect_args(out, "--json"))
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["records"] == 2


def test_text_windows_are_counted_as_training_cuts_them(tmp_path: Path) -> None:
    """n tokens make (n - 1) // sequence_length windows of sequence_length + 1."""
    path = tmp_path / "text.txt"
    path.write_text("the cat sat on the mat\n" * 20)
    args = inspect_args(path, objective="continued_pretrain", sequence_length=16)
    report = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    shown = runner.invoke(app, args, env={"COLUMNS": "200"}).stdout
    windows = (report["text_tokens"] - 1) // 16
    assert f"{windows:,} windows" in shown


def test_the_demo_check_names_a_set_with_no_perplexity_instead_of_crashing() -> None:
    point = {"step": 8, "loss": 2.0, "perplexity": 7.4, "tokens": 90}
    evals = {
        "tasks": {
            "qa": {"baseline": {**point, "perplexity": 9.0}, "latest": point},
            "all-skipped": {"baseline": {**point, "perplexity": None}, "latest": point},
            "worse": {"baseline": {**point, "perplexity": 5.0}, "latest": point},
            "never-scored": {"baseline": None, "latest": {**point, "perplexity": None}},
        }
    }
    problems = demo_problems([("pretrain", 3.0, 2.0), ("sft", 2.0, 2.5)], evals)
    assert problems == [
        "loss did not fall in phase sft (2.000 -> 2.500)",
        "eval set all-skipped: no perplexity to compare (no record scored)",
        "eval set worse: final perplexity does not beat the baseline",
        "eval set never-scored: no perplexity to compare (no record scored)",
    ]
