from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from contracts.workflow import Phase
from worker.data import (
    IGNORE_INDEX,
    TextSource,
    batch_for_step,
    encode_record,
    load_phase_data,
    record_row,
    stack_rows,
)
from worker.error import DataError
from worker.model import EOS_TOKEN, PAD_TOKEN


def phase(
    objective: str, data: list[Path], *, seq: int = 32, weights: list[float] | None = None
) -> Phase:
    weights = weights or [1.0] * len(data)
    return Phase.model_validate(
        {
            "name": "p",
            "objective": objective,
            "data": [{"path": str(d), "weight": w} for d, w in zip(data, weights, strict=True)],
            "sequence_length": seq,
            "microbatch_size": 4,
            "steps": 10,
        }
    )


def test_encode_record_is_source_then_target_then_eos(tokenizer: Tokenizer) -> None:
    record = encode_record(tokenizer, "reverse cat dog:", " dog cat")
    source = tokenizer.encode("reverse cat dog:", add_special_tokens=False).ids
    target = tokenizer.encode(" dog cat", add_special_tokens=False).ids
    assert record.ids.tolist() == [*source, *target, tokenizer.token_to_id(EOS_TOKEN)]
    assert record.source_len == len(source)
    assert record.target_len == len(target) + 1


def test_loss_mask_covers_the_target_and_eos_only(tokenizer: Tokenizer) -> None:
    record = encode_record(tokenizer, "reverse cat dog:", " dog cat")
    (pad,) = [i for t, i in tokenizer.get_vocab().items() if t == PAD_TOKEN]
    inputs, labels = record_row(record, 32, pad)
    targets = labels[labels != IGNORE_INDEX].tolist()
    assert targets == record.ids[record.source_len :].tolist()  # target tokens + EOS, in order
    # Position t predicts token t + 1: the first target is predicted from the last source token.
    first = int(np.argmax(labels != IGNORE_INDEX))
    assert first == record.source_len - 1
    assert inputs[: len(record.ids) - 1].tolist() == record.ids[:-1].tolist()
    assert set(inputs[len(record.ids) - 1 :].tolist()) == {pad}
    batch = stack_rows([(inputs, labels)])
    assert batch.target_tokens == record.target_len


def test_over_long_training_record_names_file_line_and_lengths(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    rows = [{"source": "cat", "target": "dog"}] * 3 + [{"source": "cat " * 40, "target": "dog"}]
    path = make_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataError) as caught:
        load_phase_data(phase("summarization", [path], seq=16), tokenizer)
    message = str(caught.value)
    record = encode_record(tokenizer, "cat " * 40, "dog")
    assert f"{path}:4:" in message
    assert f"encodes to {len(record.ids)} tokens" in message
    assert "sequence_length + 1 = 17" in message


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"source": "a", "target": "b"', "not valid JSON"),
        ('{"source": "a"}', "missing field 'target'"),
        ('{"source": "a", "target": 3}', "field 'target' must be a string"),
        ('["a", "b"]', "expected a JSON object"),
    ],
)
def test_bad_record_names_file_and_line(
    tmp_path: Path, tokenizer: Tokenizer, line: str, problem: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"source": "a", "target": "b"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"{path}:3: {problem}"):
        load_phase_data(phase("qa_reasoning", [path]), tokenizer)


def test_pretraining_text_is_eos_joined_windows_of_the_flat_array(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "plain.txt"
    path.write_text("the cat sat on the mat\n\nthe dog ran over the tree\n" * 20)
    data = load_phase_data(phase("continued_pretrain", [path], seq=8), tokenizer)
    (source,) = data.sources
    assert isinstance(source, TextSource)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    assert source.tokens[-1] == eos
    assert int((source.tokens == eos).sum()) == 40  # 40 documents (blank lines skipped)
    batch = batch_for_step(data, seed=0, phase_index=0, step=1, micro=0)
    assert batch.input_ids.shape == (4, 8)
    assert batch.target_tokens == 32  # every token of a window is a target
    flat = source.tokens.tolist()
    for inputs, labels in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True):
        window = [*inputs, labels[-1]]
        assert labels == window[1:]
        assert any(flat[o : o + 9] == window for o in range(len(flat) - 8))


def test_batch_for_step_is_a_pure_function_of_its_arguments(
    tokenizer: Tokenizer, make_pairs_file: Callable[..., Path]
) -> None:
    path = make_pairs_file(records=200)
    p = phase("instruction_tuning", [path])
    first = load_phase_data(p, tokenizer)
    second = load_phase_data(p, tokenizer)  # as in a fresh process: no state carried over

    def ids(data: object, **kw: int) -> torch.Tensor:
        return batch_for_step(data, **kw).input_ids  # type: ignore[arg-type]

    args = {"seed": 3, "phase_index": 1, "step": 17, "micro": 2}
    assert torch.equal(ids(first, **args), ids(second, **args))
    ids(first, **{**args, "step": 5})  # drawing other batches in between changes nothing
    assert torch.equal(ids(first, **args), ids(second, **args))
    for changed in ({"step": 18}, {"micro": 1}, {"seed": 4}, {"phase_index": 0}):
        assert not torch.equal(ids(first, **args), ids(first, **{**args, **changed}))


def test_mixture_picks_sources_by_weight(
    tokenizer: Tokenizer, make_text_file: Callable[..., Path]
) -> None:
    a, b = make_text_file("a.jsonl", seed=1), make_text_file("b.jsonl", seed=2)
    data = load_phase_data(phase("continued_pretrain", [a, b], weights=[3.0, 1.0]), tokenizer)
    assert isinstance(data.sources[0], TextSource)
    a_tokens = data.sources[0].tokens.tolist()

    def from_a(step: int) -> bool:
        row = batch_for_step(data, seed=0, phase_index=0, step=step, micro=0).input_ids[0].tolist()
        return any(a_tokens[o : o + len(row)] == row for o in range(len(a_tokens) - len(row)))

    share = sum(from_a(step) for step in range(1, 201)) / 200
    assert 0.65 < share < 0.85  # 3:1 -> 0.75


def test_a_supervised_phase_replays_pretraining_text_as_windows(
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
) -> None:
    pairs, text = make_pairs_file(), make_text_file("replay.jsonl")
    data = load_phase_data(phase("summarization", [pairs, text], weights=[1.0, 1.0]), tokenizer)
    kinds = {type(s).__name__ for s in data.sources}
    assert kinds == {"RecordSource", "TextSource"}
    counts = set()
    for step in range(1, 40):
        batch = batch_for_step(data, seed=0, phase_index=1, step=step, micro=0)
        counts.add(batch.target_tokens)
    # Replay windows are all targets (4 x 32); supervised rows only their targets.
    assert 4 * 32 in counts and min(counts) < 4 * 32 // 2
