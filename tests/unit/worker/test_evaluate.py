from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from contracts.workflow import EvalSpec, Workflow, perplexity
from worker.data import (
    encode_records,
    encode_texts,
    read_pairs,
    read_texts,
    record_row,
    stack_rows,
    window_row,
)
from worker.evaluate import evaluate_task
from worker.model import PAD_TOKEN, build_model
from worker.objective import backward_step, objective_loss

SEQ = 32


@pytest.fixture
def workflow(
    make_workflow: Callable[..., Workflow], make_pairs_file: Callable[..., Path]
) -> Workflow:
    return make_workflow(
        [{"name": "sft", "objective": "summarization", "data": [make_pairs_file()], "steps": 4}],
        model={"attention_dropout": 0.2},
    )


def test_eval_equals_the_training_loss_without_gradients(
    workflow: Workflow, tokenizer: Tokenizer, make_pairs_file: Callable[..., Path]
) -> None:
    path = make_pairs_file("eval.jsonl", records=10, seed=5)
    model = build_model(workflow, torch.device("cpu"))
    spec = EvalSpec(task="summarization", data=str(path))

    result = evaluate_task(
        model, tokenizer, spec, sequence_length=SEQ, batch_size=4, step=3, phase="sft"
    )

    # The same records as the trainer batches them: rows padded to sequence_length, split
    # into microbatches of one optimizer step.
    (pad,) = [i for t, i in tokenizer.get_vocab().items() if t == PAD_TOKEN]
    records = encode_records(tokenizer, [(s, t) for _, s, t in read_pairs(str(path))])
    rows = [record_row(r, SEQ, pad) for r in records]
    microbatches = [stack_rows(rows[i : i + 4]) for i in range(0, len(rows), 4)]
    model.eval()  # dropout off, as in evaluation; gradients on, as in training
    training_loss = backward_step(model, microbatches).item()

    assert result.cross_entropy == pytest.approx(training_loss, rel=1e-5)
    assert result.target_tokens == sum(b.target_tokens for b in microbatches)
    assert result.records == 10
    assert result.perplexity == pytest.approx(perplexity(training_loss), rel=1e-5)
    assert (result.step, result.phase, result.task) == (3, "sft", "summarization")
    assert any(p.grad is not None for p in model.parameters())  # the training path ran


@pytest.mark.parametrize("task", ["qa_reasoning", "continued_pretrain"])
def test_eval_does_not_depend_on_the_batch_size(
    task: str,
    workflow: Workflow,
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
) -> None:
    if task == "continued_pretrain":
        path = make_text_file(documents=30)
    else:
        path = make_pairs_file(records=23)
    model = build_model(workflow, torch.device("cpu"))
    spec = EvalSpec.model_validate({"task": task, "data": str(path)})
    results = [
        evaluate_task(model, tokenizer, spec, sequence_length=SEQ, batch_size=b, step=0, phase="p")
        for b in (1, 3, 64)
    ]
    assert len({r.target_tokens for r in results}) == 1
    for r in results[1:]:
        assert r.cross_entropy == pytest.approx(results[0].cross_entropy, rel=1e-6)


def test_eval_skips_and_counts_records_that_do_not_fit(
    workflow: Workflow, tokenizer: Tokenizer, make_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    short = {"source": "reverse cat dog:", "target": " dog cat"}
    long = {"source": "the cat sat on the mat " * 10, "target": " mat"}
    path = make_jsonl(tmp_path / "mixed.jsonl", [short, long, short, long, long])
    model = build_model(workflow, torch.device("cpu"))
    result = evaluate_task(
        model,
        tokenizer,
        EvalSpec(task="retrieval_planning", data=str(path)),
        sequence_length=SEQ,
        batch_size=2,
        step=0,
        phase="p",
    )
    fits, too_long = encode_records(
        tokenizer, [(short["source"], short["target"]), (long["source"], long["target"])]
    )
    assert len(fits.ids) <= SEQ + 1 < len(too_long.ids)
    assert (result.records, result.oversized_records) == (2, 3)
    assert result.target_tokens == 2 * fits.target_len


def test_pretraining_eval_predicts_every_token_after_the_first_once(
    workflow: Workflow, tokenizer: Tokenizer, make_text_file: Callable[..., Path]
) -> None:
    path = make_text_file(documents=17)
    model = build_model(workflow, torch.device("cpu"))
    result = evaluate_task(
        model,
        tokenizer,
        EvalSpec(task="continued_pretrain", data=str(path)),
        sequence_length=SEQ,
        batch_size=4,
        step=0,
        phase="p",
    )
    tokens = encode_texts(tokenizer, read_texts(str(path)))
    assert result.target_tokens == len(tokens) - 1
    assert result.records == 17
    # Windows whose inputs do not overlap, cut by hand, give the same loss.
    (pad,) = [i for t, i in tokenizer.get_vocab().items() if t == PAD_TOKEN]
    windows = [tokens[s : s + SEQ + 1] for s in range(0, len(tokens) - 1, SEQ)]
    model.eval()
    with torch.no_grad():
        nll = 0.0
        for window in windows:
            nll += objective_loss(model, stack_rows([window_row(window, SEQ, pad)]))[0].item()
    assert result.cross_entropy == pytest.approx(nll / (len(tokens) - 1), rel=1e-5)


def test_eval_restores_train_mode_and_leaves_no_gradients(
    workflow: Workflow, tokenizer: Tokenizer, make_pairs_file: Callable[..., Path]
) -> None:
    model = build_model(workflow, torch.device("cpu"))
    assert model.training
    evaluate_task(
        model,
        tokenizer,
        EvalSpec(task="summarization", data=str(make_pairs_file(records=5))),
        sequence_length=SEQ,
        batch_size=2,
        step=0,
        phase="p",
    )
    assert model.training
    assert all(p.grad is None for p in model.parameters())
