"""Per-task evaluation and the one objective it shares with training."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from contracts.bounds import MAX_SKIPPED_EXAMPLES
from contracts.jobs import EvaluateRequest
from contracts.reports import skipped_share
from contracts.workflow import EvalSpec, Phase, perplexity
from worker.data.batch import (
    Batch,
    load_phase_data,
    packed_rows,
    record_row,
    stack_rows,
    window_row,
)
from worker.data.encode import Encoded, encode_records
from worker.data.records import parse_record, read_records
from worker.data.store import Stores
from worker.data.tokenizer import special_token_ids
from worker.error import ConfigError, DataError
from worker.train.evaluate import evaluate_checkpoint, evaluate_task, load_eval_data
from worker.train.objective import backward_step, objective_loss

SEQ = 32

PASSAGE = " the cat sat on the mat and then it ran over the tree"
MIXED: list[dict[str, Any]] = [
    {"source": "reverse cat dog:", "target": " dog cat"},
    {"source": "the big red bird", "target": " flew over the roof quickly"},
    {
        "messages": [
            {"role": "user", "content": "the bird?"},
            {"role": "assistant", "content": "it flew"},
        ]
    },
    {
        "segments": [
            {"text": "Answer.\n", "role": "instruction"},
            {"text": PASSAGE * 3, "role": "passage", "elastic": "end"},
            {"text": "\nWhere?", "role": "question"},
        ],
        "target": " on the mat",
    },
    {"source": "a", "target": " small blue cat sat"},
    {"source": "the dog ran", "target": " under the tree"},
]


def spec(task: str, path: Path) -> EvalSpec:
    return EvalSpec.model_validate({"task": task, "data": str(path)})


def pack(encoded: Sequence[Encoded], length: int) -> list[list[Encoded]]:
    """Records in file order, laid greedily into rows of `length` positions."""
    rows: list[list[Encoded]] = [[]]
    fill = 0
    for e in encoded:
        size = len(e.ids) - 1
        if fill + size > length:
            rows.append([])
            fill = 0
        rows[-1].append(e)
        fill += size
    return rows


def test_eval_equals_the_training_loss_without_gradients(
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    path = make_jsonl(tmp_path / "eval.jsonl", MIXED * 2)
    model = make_model(attention_dropout=0.2)  # eval mode matters: dropout is on in training
    data = load_eval_data(tokenizer, spec("summarization", path), sequence_length=SEQ)
    result = evaluate_task(model, data, batch_size=4, step=3, phase="sft")

    # The same records as training takes them: one encoder, packed into rows of sequence_length
    # with their block-diagonal masks, in microbatches of one optimizer step.
    encoded = encode_records(tokenizer, read_records(str(path)), sequence_length=SEQ)
    assert all(e.usable for e in encoded)
    _, pad_id = special_token_ids(tokenizer)
    rows = pack(encoded, SEQ)
    microbatches = [packed_rows(rows[:2], SEQ, pad_id), packed_rows(rows[2:], SEQ, pad_id)]
    assert microbatches[0].target_tokens != microbatches[1].target_tokens
    model.eval()  # dropout off, as in evaluation; gradients on, as in training
    training = backward_step(model, microbatches)

    assert result.cross_entropy == pytest.approx(training.loss.item(), rel=1e-5)
    assert result.target_tokens == sum(b.target_tokens for b in microbatches)
    assert result.target_tokens == sum(e.target_count for e in encoded)
    assert result.records == len(MIXED) * 2 and result.oversized_records == 0
    assert result.perplexity == pytest.approx(perplexity(training.loss.item()), rel=1e-5)
    assert (result.step, result.phase, result.task) == (3, "sft", "summarization")
    assert any(p.grad is not None for p in model.parameters())  # the training path ran


@pytest.mark.parametrize("task", ["qa_reasoning", "continued_pretrain"])
def test_eval_does_not_depend_on_the_batch_size(
    task: str,
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    make_text_file: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    if task == "continued_pretrain":
        path = make_text_file(documents=30)
    else:
        path = make_jsonl(tmp_path / "mixed.jsonl", MIXED * 4)
    model = make_model()
    data = load_eval_data(tokenizer, spec(task, path), sequence_length=SEQ)
    assert len(data.rows) > 6
    results = [
        evaluate_task(model, data, batch_size=b, step=0, phase="p") for b in (1, 3, len(data.rows))
    ]
    assert len({(r.target_tokens, r.records) for r in results}) == 1
    for r in results[1:]:
        assert r.cross_entropy == pytest.approx(results[0].cross_entropy, rel=1e-6)


def test_eval_skips_and_counts_records_that_do_not_fit(
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    short = {"source": "reverse cat dog:", "target": " dog cat"}
    long = {"source": "the cat sat on the mat " * 10, "target": " mat"}
    fitted = MIXED[3]  # too long as written; fits once its passage is trimmed
    path = make_jsonl(tmp_path / "mixed.jsonl", [short, long, fitted, short, long, long])
    data = load_eval_data(tokenizer, spec("retrieval_planning", path), sequence_length=SEQ)
    result = evaluate_task(make_model(), data, batch_size=2, step=0, phase="p")

    records = read_records(str(path))
    encoded = encode_records(tokenizer, records, sequence_length=SEQ)
    assert [e.report.fits for e in encoded] == [True, False, True, True, False, False]
    assert encoded[2].report.trimmed_segments == (1,)
    assert (result.records, result.oversized_records) == (3, 3)
    assert result.target_tokens == 2 * encoded[0].target_count + encoded[2].target_count


def test_pretraining_eval_predicts_every_token_after_the_first_once(
    tokenizer: Tokenizer,
    make_text_file: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    path = make_text_file(documents=17)
    model = make_model()
    data = load_eval_data(tokenizer, spec("continued_pretrain", path), sequence_length=SEQ)
    result = evaluate_task(model, data, batch_size=4, step=0, phase="p")
    encoded = encode_records(tokenizer, read_records(str(path)), sequence_length=None)
    tokens = [t for e in encoded for t in e.ids.tolist()]
    assert result.target_tokens == len(tokens) - 1
    assert (result.records, result.oversized_records) == (17, 0)
    # Windows whose inputs do not overlap, cut by hand, give the same loss.
    _, pad_id = special_token_ids(tokenizer)
    windows = [tokens[s : s + SEQ + 1] for s in range(0, len(tokens) - 1, SEQ)]
    assert len(windows[-1]) < SEQ + 1  # the last, short window is evaluated too
    model.eval()
    with torch.no_grad():
        nll = 0.0
        for w in windows:
            row = window_row(np.array(w), len(w) - 1, pad_id)
            nll += objective_loss(model, stack_rows([row]))[0].item()
    assert result.cross_entropy == pytest.approx(nll / (len(tokens) - 1), rel=1e-5)


@pytest.mark.parametrize("training", [True, False])
def test_eval_restores_the_model_mode_and_leaves_no_gradients(
    training: bool,
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    model = make_model().train(training)
    data = load_eval_data(
        tokenizer, spec("summarization", make_pairs_file(records=5)), sequence_length=SEQ
    )
    evaluate_task(model, data, batch_size=2, step=0, phase="p")
    assert model.training is training
    assert all(m.training is training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_checkpoint_gives_the_number_evaluate_task_gives_for_the_same_model(
    tmp_path: Path,
    tokenizer_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    path = make_jsonl(tmp_path / "eval.jsonl", MIXED)
    model = make_model(seed=3)
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    shutil.copy(tokenizer_path, checkpoint / "tokenizer.json")

    data = load_eval_data(tokenizer, spec("qa_reasoning", path), sequence_length=SEQ)
    expected = evaluate_task(model, data, batch_size=8, step=0, phase="")
    request = {"checkpoint": str(checkpoint), "task": "qa_reasoning", "data": str(path)}
    result = evaluate_checkpoint(EvaluateRequest(**request, sequence_length=SEQ))
    assert result.cross_entropy == pytest.approx(expected.cross_entropy, rel=1e-6)
    assert result.model_dump() == {
        **expected.model_dump(),
        "cross_entropy": result.cross_entropy,
        "perplexity": result.perplexity,
    }

    # A trainctl checkpoint names its step and phase; a tokenizer may be given explicitly.
    (checkpoint / "state.json").write_text(json.dumps({"step": 12, "phase_name": "sft"}))
    (checkpoint / "tokenizer.json").unlink()
    again = evaluate_checkpoint(
        EvaluateRequest(**request, tokenizer=str(tokenizer_path), sequence_length=SEQ, batch_size=1)
    )
    assert (again.step, again.phase) == (12, "sft")
    assert again.cross_entropy == pytest.approx(expected.cross_entropy, rel=1e-6)
    # A state file that is not trainctl's is a clear error, not a traceback.
    (checkpoint / "state.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a trainctl state file"):
        evaluate_checkpoint(
            EvaluateRequest(**request, tokenizer=str(tokenizer_path), sequence_length=SEQ)
        )


def test_evaluate_checkpoint_refuses_a_directory_without_a_model(
    tmp_path: Path, tokenizer_path: Path
) -> None:
    request = EvaluateRequest(
        checkpoint=str(tmp_path),
        task="summarization",
        data=str(tmp_path / "x.jsonl"),
        tokenizer=str(tokenizer_path),
        sequence_length=SEQ,
    )
    with pytest.raises(ConfigError, match="no config\\.json"):
        evaluate_checkpoint(request)


# --- the step loss --------------------------------------------------------------------------


def microbatch(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], *, source: int) -> Batch:
    records = [
        parse_record("f.jsonl", i + 1, json.dumps({"source": s, "target": t}))
        for i, (s, t) in enumerate(pairs)
    ]
    _, pad_id = special_token_ids(tokenizer)
    encoded = encode_records(tokenizer, records, sequence_length=SEQ)
    return stack_rows([record_row(e, SEQ, pad_id) for e in encoded], source=source)


def test_the_step_loss_is_its_total_nll_over_its_target_tokens_not_a_mean_of_means(
    tokenizer: Tokenizer, make_model: Callable[..., PreTrainedModel]
) -> None:
    microbatches = [
        microbatch(
            tokenizer, [("the cat:", " the big red bird flew over the roof quickly")], source=0
        ),
        microbatch(tokenizer, [("a", " b"), ("the dog:", " sat")], source=1),
        microbatch(tokenizer, [("cat", " dog")], source=0),
    ]
    counts = [b.target_tokens for b in microbatches]
    assert len(set(counts)) == 3
    model = make_model()
    with torch.no_grad():
        nlls = [objective_loss(model, b)[0].item() for b in microbatches]
    expected = sum(nlls) / sum(counts)
    mean_of_means = sum(n / c for n, c in zip(nlls, counts, strict=True)) / len(counts)
    assert abs(expected - mean_of_means) > 1e-3  # the two definitions differ on this data

    step = backward_step(model, microbatches)
    assert step.loss.item() == pytest.approx(expected, rel=1e-6)
    assert not step.loss.requires_grad
    assert set(step.by_source) == {0, 1}
    assert step.by_source[0][0].item() == pytest.approx(nlls[0] + nlls[2], rel=1e-6)
    assert step.by_source[0][1] == counts[0] + counts[2]
    assert step.by_source[1][0].item() == pytest.approx(nlls[1], rel=1e-6)
    assert step.by_source[1][1] == counts[1]

    # The accumulated gradient is the gradient of that one loss.
    accumulated = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    total = sum(objective_loss(model, b)[0] for b in microbatches) / sum(counts)
    assert isinstance(total, torch.Tensor)
    total.backward()
    direct = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(direct) == len(accumulated) > 0
    for a, d in zip(accumulated, direct, strict=True):
        torch.testing.assert_close(a, d, rtol=1e-5, atol=1e-7)


def test_a_step_without_target_tokens_is_an_error(
    tokenizer: Tokenizer, make_model: Callable[..., PreTrainedModel]
) -> None:
    _, pad_id = special_token_ids(tokenizer)
    inputs = torch.full((1, SEQ), pad_id)
    empty = Batch(input_ids=inputs, labels=torch.full((1, SEQ), -100), target_tokens=0)
    with pytest.raises(ValueError, match="without target tokens"):
        backward_step(make_model(), [empty])


# --- records an eval set cannot score ----------------------------------------------------------

SHORT = {"source": "reverse cat dog:", "target": " dog cat"}
LONG = {"source": "the cat sat on the mat " * 10, "target": " mat"}


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_qa_eval_file_with_an_unterminated_json_line_is_scored_without_it(
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    # The case: the line cut short failed the run at step 0.
    clean = make_jsonl(tmp_path / "clean.jsonl", [*MIXED[:2], *MIXED[4:]])
    lines = (
        [json.dumps(r) for r in MIXED[:2]]
        + ['{"source": "a", "target": " b']
        + [json.dumps(r) for r in MIXED[4:]]
    )
    path = write_lines(tmp_path / "qa.eval.jsonl", lines)
    model = make_model()
    data = load_eval_data(tokenizer, spec("qa_reasoning", path), sequence_length=SEQ)
    result = evaluate_task(model, data, batch_size=2, step=0, phase="p")
    assert (result.records, result.oversized_records) == (4, 0)
    assert result.skipped_records == {"malformed_json": 1}
    assert result.skipped_examples == [
        f"{path}:3: not valid JSON (Unterminated string starting at at column 27)"
    ]
    # What is scored is the file without the line.
    without = load_eval_data(tokenizer, spec("qa_reasoning", clean), sequence_length=SEQ)
    expected = evaluate_task(model, without, batch_size=2, step=0, phase="p")
    assert (result.cross_entropy, result.target_tokens) == (
        expected.cross_entropy,
        expected.target_tokens,
    )


def test_every_record_an_eval_set_cannot_score_is_skipped_and_counted_by_reason(
    tmp_path: Path, tokenizer: Tokenizer, make_model: Callable[..., PreTrainedModel]
) -> None:
    lines = [
        json.dumps(SHORT),
        "{oops",  # 2: not JSON
        json.dumps({"source": "cat"}),  # 3: a pair without its target
        json.dumps({"id": 7, "body": "x"}),  # 4: no record's shape
        json.dumps({"text": "the cat sat"}),  # 5: text, where a qa set reads supervised records
        json.dumps({"source": "cat", "target": ""}),  # 6: nothing to score
        json.dumps(LONG),  # 7: too long for SEQ
        json.dumps(MIXED[1]),
        '["a", "b"]',  # 9: JSON, not an object
    ]
    path = write_lines(tmp_path / "qa.eval.jsonl", lines)
    data = load_eval_data(tokenizer, spec("qa_reasoning", path), sequence_length=SEQ)
    result = evaluate_task(make_model(), data, batch_size=2, step=0, phase="p")
    assert (result.records, result.oversized_records) == (2, 1)
    assert result.skipped_records == {"malformed_json": 1, "wrong_shape": 4, "no_target": 1}
    assert skipped_share(result.records, result.oversized_records, result.skipped_records) == (
        7 / 9
    )
    # The first few, by line, each reason's first among them.
    expected = [
        f"{path}:2: not valid JSON (Expecting property name enclosed in double quotes",
        f"{path}:3: missing field 'target'",
        f"{path}:4: unknown record with keys ['body', 'id']; expected",
        f"{path}:6: pair record with no target tokens: nothing of it can be scored",
        f"{path}:7: encodes to 126 tokens (prompt 122 + target and EOS 4), more than "
        "sequence_length + 1 = 33",
    ]
    assert len(result.skipped_examples) == len(expected)
    for example, start in zip(result.skipped_examples, expected, strict=True):
        assert example.startswith(start), (example, start)


def test_skipped_examples_are_capped_and_keep_each_reason_s_first(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    lines = [json.dumps(SHORT)] + [json.dumps(LONG)] * 8 + ["{oops"] * 3
    path = write_lines(tmp_path / "qa.eval.jsonl", lines)
    data = load_eval_data(tokenizer, spec("qa_reasoning", path), sequence_length=SEQ)
    assert (data.records, data.oversized_records, data.skipped_records) == (
        1,
        8,
        {"malformed_json": 3},
    )
    assert len(data.skipped_examples) == MAX_SKIPPED_EXAMPLES
    lines_named = [int(e.removeprefix(f"{path}:").split(":")[0]) for e in data.skipped_examples]
    assert lines_named == [2, 3, 4, 5, 10]  # the first malformed line, after 8 too long


def test_a_text_eval_set_scores_its_text_records_only(
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_jsonl: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    texts = [{"text": f"the cat sat on the mat {w}"} for w in ("and ran", "then flew", "quickly")]
    clean = make_jsonl(tmp_path / "clean.jsonl", texts)
    mixed = make_jsonl(tmp_path / "mixed.jsonl", [texts[0], SHORT, texts[1], texts[2]])
    with mixed.open("a") as f:
        f.write("{oops\n")
    model = make_model()
    data = load_eval_data(tokenizer, spec("continued_pretrain", mixed), sequence_length=SEQ)
    result = evaluate_task(model, data, batch_size=2, step=0, phase="p")
    assert (result.records, result.oversized_records) == (3, 0)
    assert result.skipped_records == {"malformed_json": 1, "wrong_shape": 1}
    assert result.skipped_examples[0] == (
        f"{mixed}:2: a pair record where continued_pretrain reads text"
    )
    # The pair's tokens are not in the windows: the same number as the text alone.
    alone = load_eval_data(tokenizer, spec("continued_pretrain", clean), sequence_length=SEQ)
    expected = evaluate_task(model, alone, batch_size=2, step=0, phase="p")
    assert (result.cross_entropy, result.target_tokens) == (
        expected.cross_entropy,
        expected.target_tokens,
    )


@pytest.mark.parametrize(
    ("task", "lines", "why"),
    [
        ("summarization", [json.dumps(LONG)], "1 too long; first: {path}:1: encodes to"),
        ("qa_reasoning", ["{oops", "{"], "2 malformed JSON; first: {path}:1: not valid JSON"),
        ("qa_reasoning", ["plain text, not JSON"], "1 malformed JSON; first: {path}:1: not"),
        ("continued_pretrain", [json.dumps(SHORT)], "1 wrong shape; first: {path}:1: a pair"),
        ("qa_reasoning", [], "it holds no records"),
    ],
)
def test_a_set_with_nothing_to_score_fails_when_loaded_naming_the_file(
    tmp_path: Path, tokenizer: Tokenizer, task: str, lines: list[str], why: str
) -> None:
    path = write_lines(tmp_path / "held-out.jsonl", lines)
    with pytest.raises(DataError) as refused:
        load_eval_data(tokenizer, spec(task, path), sequence_length=SEQ)
    message = str(refused.value)
    assert message.startswith(f"{path}: nothing to evaluate in eval set {task!r}"), message
    assert why.format(path=path) in message


def test_training_still_refuses_a_file_whose_store_an_eval_built(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    # One store per file, shared: the eval set's leniency is not training's.
    path = make_jsonl(tmp_path / "qa.jsonl", [SHORT] * 3)
    with path.open("a") as f:
        f.write('{"source": "a"}\n{oops\n')
    stores = Stores(tmp_path / "tokens", tokenizer)
    data = load_eval_data(tokenizer, spec("qa_reasoning", path), sequence_length=SEQ, stores=stores)
    assert data.skipped_records == {"wrong_shape": 1, "malformed_json": 1}
    phase = Phase.model_validate(
        {
            "name": "sft",
            "objective": "qa_reasoning",
            "data": [{"path": str(path)}],
            "sequence_length": SEQ,
            "microbatch_size": 1,
            "steps": 1,
        }
    )
    with pytest.raises(DataError) as refused:
        load_phase_data(phase, tokenizer, stores=stores)
    assert str(refused.value) == (
        f"{path}:4: missing field 'target' (source 'qa' of phase 'sft'; 1 more lines of it are "
        "not records either)"
    )
