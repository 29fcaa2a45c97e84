"""A phase's training data: refusals, packing, envelope, mixtures and pure batches."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from contracts.workflow import Phase
from worker.data.batch import (
    IGNORE_INDEX,
    Batch,
    PhaseData,
    RecordSource,
    TextSource,
    batch_for_step,
    load_phase_data,
    mixture_schedule,
    packed_rows,
)
from worker.data.encode import encode_record, encode_records
from worker.data.records import parse_record, read_records
from worker.data.store import ENCODE_BATCH
from worker.data.tokenizer import EOS_TOKEN, special_token_ids
from worker.error import DataError
from worker.train.objective import objective_loss

ENVELOPE = 128  # sequence_length x microbatch_size of every source below


def phase(
    data: Sequence[Path | Mapping[str, Any]],
    *,
    objective: str = "instruction_tuning",
    seq: int = 32,
    mbs: int = 4,
    steps: int = 10,
    grad_accum: int = 1,
) -> Phase:
    return Phase.model_validate(
        {
            "name": "p",
            "objective": objective,
            "data": [{"path": str(d)} if isinstance(d, Path) else dict(d) for d in data],
            "sequence_length": seq,
            "microbatch_size": mbs,
            "grad_accum": grad_accum,
            "steps": steps,
        }
    )


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def batches(data: PhaseData, *, steps: int, seed: int = 0, phase_index: int = 0) -> list[Batch]:
    return [
        batch_for_step(data, seed=seed, phase_index=phase_index, step=s, micro=m)
        for s in range(1, steps + 1)
        for m in range(data.grad_accum)
    ]


def record_spans(batch: Batch, pad_id: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every record packed in `batch`: a record starts where positions
    restart; padding (pad_id) is the tail of a row."""
    assert batch.position_ids is not None
    spans = []
    for r, (ids, pos) in enumerate(
        zip(batch.input_ids.tolist(), batch.position_ids.tolist(), strict=True)
    ):
        used = sum(1 for t in ids if t != pad_id)
        assert all(t != pad_id for t in ids[:used]), "padding only at the end of a row"
        starts = [t for t in range(used) if pos[t] == 0]
        assert starts[:1] == [0]
        for start, end in zip(starts, [*starts[1:], used], strict=True):
            assert pos[start:end] == list(range(end - start))
            spans.append((r, start, end))
    return spans


def chat_file(path: Path, count: int = 12) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"the {animal} ?"},
                {"role": "assistant", "content": f"the {animal} sat"},
            ]
        }
        for animal in ("cat", "dog", "bird") * (count // 3)
    ]
    return write_lines(path, [json.dumps(r) for r in rows])


# --- pretraining text -----------------------------------------------------------------------


def test_pretraining_text_is_eos_joined_windows_of_the_flat_array(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = write_lines(
        tmp_path / "plain.txt", ["the cat sat on the mat", "", "the dog ran over the tree"] * 20
    )
    data = load_phase_data(phase([path], objective="continued_pretrain", seq=8), tokenizer)
    (source,) = data.sources
    assert isinstance(source, TextSource)
    eos, _ = special_token_ids(tokenizer)
    expected = []
    for text in ["the cat sat on the mat", "the dog ran over the tree"] * 20:
        expected += [*tokenizer.encode(text, add_special_tokens=False).ids, eos]
    assert source.tokens.tolist() == expected  # 40 documents, blank lines skipped

    batch = batch_for_step(data, seed=0, phase_index=0, step=1, micro=0)
    assert batch.input_ids.shape == (4, 8)
    assert batch.attention_mask is None and batch.position_ids is None  # documents see each other
    assert batch.target_tokens == 32  # every position predicts the next token
    for inputs, labels in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True):
        window = [*inputs, labels[-1]]
        assert labels == window[1:]
        assert any(expected[k * 8 : k * 8 + 9] == window for k in range(source.windows))


def test_an_epoch_of_pretraining_windows_visits_every_window_once(
    tokenizer: Tokenizer, make_text_file: Callable[..., Path]
) -> None:
    data = load_phase_data(
        phase([make_text_file(documents=40)], objective="continued_pretrain", steps=40), tokenizer
    )
    (source,) = data.sources
    assert isinstance(source, TextSource)
    flat, seq, windows = source.tokens.tolist(), 32, source.windows
    seen = []
    for batch in batches(data, steps=40):
        for inputs, labels in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True):
            window = [*inputs, labels[-1]]
            (k,) = [k for k in range(windows) if flat[k * seq : k * seq + seq + 1] == window]
            seen.append(k)
    assert len(seen) > 2 * windows
    for epoch in range(len(seen) // windows):
        assert sorted(seen[epoch * windows : (epoch + 1) * windows]) == list(range(windows))
    assert seen[:windows] != list(range(windows))  # in a seeded order, not file order


def test_text_shorter_than_one_window_is_an_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_lines(tmp_path / "tiny.txt", ["the cat"])
    with pytest.raises(DataError, match="fewer than one window of sequence_length \\+ 1 = 33"):
        load_phase_data(phase([path], objective="continued_pretrain"), tokenizer)


# --- refusals -------------------------------------------------------------------------------


def test_an_empty_source_is_an_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    good = write_lines(tmp_path / "good.jsonl", ['{"source": "a", "target": " b"}'])
    empty = write_lines(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(DataError, match=f"^{re.escape(str(empty))}: no records \\(phase 'p'\\)"):
        load_phase_data(phase([good, empty]), tokenizer)


def test_a_text_record_in_a_supervised_source_is_an_error_with_a_replay_hint(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = write_lines(
        tmp_path / "mixed.jsonl",
        ['{"source": "a", "target": " b"}', "", '{"text": "the cat sat"}'],
    )
    with pytest.raises(DataError) as caught:
        load_phase_data(phase([path]), tokenizer)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: a text record in source 'mixed' of phase 'p'")
    assert '"objective": "continued_pretrain"' in message


def test_a_supervised_record_in_a_pretraining_source_is_an_error(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = write_lines(
        tmp_path / "text.jsonl", ['{"text": "the cat sat"}', '{"source": "a", "target": " b"}']
    )
    replay = {"path": str(path), "objective": "continued_pretrain"}
    good = write_lines(tmp_path / "good.jsonl", ['{"source": "a", "target": " b"}'])
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:2: a pair record in source"):
        load_phase_data(phase([good, replay]), tokenizer)


def test_an_oversized_training_record_is_refused_naming_file_line_and_lengths(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    short, long = {"source": "cat", "target": " dog"}, {"source": "cat " * 40, "target": " dog"}
    path = make_jsonl(tmp_path / "long.jsonl", [short, short, short, long, short, long])
    with pytest.raises(DataError) as caught:
        load_phase_data(phase([path], seq=16, mbs=8), tokenizer)
    encoded = encode_record(
        tokenizer, parse_record(str(path), 4, json.dumps(long)), sequence_length=None
    )
    prompt = encoded.report.source_tokens
    message = str(caught.value)
    assert message.startswith(
        f"{path}:4: pair record encodes to {len(encoded.ids)} tokens (prompt {prompt} + target "
        f"and EOS {len(encoded.ids) - prompt}), more than sequence_length + 1 = 17 "
        "(source 'long', sequence_length 16, phase 'p')"
    )
    assert "raise sequence_length" in message
    assert "(1 more of 6 records are refused too)" in message


def test_a_training_record_without_target_tokens_is_refused_naming_file_and_line(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    path = make_jsonl(
        tmp_path / "empty_target.jsonl",
        [{"source": "cat", "target": " dog"}, {"source": "cat", "target": ""}],
    )
    with pytest.raises(DataError) as caught:
        load_phase_data(phase([path]), tokenizer)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: pair record no target tokens")
    assert "give it a target" in message


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"source": "a", "target": "b"', "not valid JSON"),
        ('{"source": "a"}', "missing field 'target'"),
        ('{"messages": [{"role": "user"}]}', "messages\\[0\\]: missing field 'content'"),
    ],
)
def test_a_malformed_record_stops_loading_naming_file_and_line(
    tmp_path: Path, tokenizer: Tokenizer, line: str, problem: str
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", ['{"source": "a", "target": "b"}', "", line])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: {problem}"):
        load_phase_data(phase([path]), tokenizer)


def test_a_segmented_record_too_long_is_fitted_for_training_not_refused(
    tmp_path: Path, tokenizer: Tokenizer, make_jsonl: Callable[..., Path]
) -> None:
    value = {
        "segments": [
            {"text": "Answer.\n", "role": "instruction"},
            {"text": " the cat sat on the mat" * 8, "role": "passage", "elastic": True},
            {"text": "\nWhere?", "role": "question"},
        ],
        "target": " on the mat",
    }
    path = make_jsonl(tmp_path / "rag.jsonl", [value])
    data = load_phase_data(phase([path]), tokenizer)
    record = parse_record(str(path), 1, json.dumps(value))
    fitted = encode_record(tokenizer, record, sequence_length=32)
    assert fitted.report.dropped_segments == (1,) and fitted.usable
    batch = batch_for_step(data, seed=0, phase_index=0, step=1, micro=0)
    k = len(fitted.ids) - 1
    assert batch.input_ids[0, :k].tolist() == fitted.ids[:-1].tolist()
    labels = np.where(fitted.loss_mask[1:], fitted.ids[1:], IGNORE_INDEX)
    assert batch.labels[0, :k].tolist() == labels.tolist()


# --- packing and the envelope ---------------------------------------------------------------


def test_every_microbatch_fills_its_source_geometry_and_padding_is_never_a_target(
    tmp_path: Path,
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
) -> None:
    pairs, chats = make_pairs_file(records=30), chat_file(tmp_path / "chat.jsonl")
    replay = {
        "path": str(make_text_file("replay.jsonl")),
        "objective": "continued_pretrain",
        "sequence_length": 16,
        "microbatch_size": 8,
    }
    data = load_phase_data(phase([pairs, chats, replay], steps=20, grad_accum=2), tokenizer)
    _, pad_id = special_token_ids(tokenizer)
    seen: Counter[int] = Counter()
    for batch in batches(data, steps=20):
        geometry = data.sources[batch.source].geometry
        seq, rows = geometry.sequence_length, geometry.microbatch_size
        seen[batch.source] += 1
        assert batch.input_ids.shape == batch.labels.shape == (rows, seq)
        assert rows * seq == ENVELOPE
        assert batch.target_tokens == int((batch.labels != IGNORE_INDEX).sum())
        if geometry.objective == "continued_pretrain":
            assert batch.attention_mask is None
            assert batch.target_tokens == ENVELOPE
            continue
        assert batch.attention_mask is not None and batch.position_ids is not None
        assert batch.attention_mask.shape == (rows, 1, seq, seq)
        assert batch.position_ids.shape == (rows, seq)
        padding = batch.input_ids == pad_id
        assert bool((batch.labels[padding] == IGNORE_INDEX).all())
        spans = record_spans(batch, pad_id)
        for r, _, end in spans:
            # A record's last position predicts its EOS: each record closes with a target.
            assert int(batch.labels[r, end - 1]) == special_token_ids(tokenizer)[0]
        assert 0 < batch.target_tokens < ENVELOPE
    assert set(seen) == {0, 1, 2}


def test_a_packed_row_computes_each_record_as_it_would_alone(
    tokenizer: Tokenizer, make_model: Callable[..., PreTrainedModel]
) -> None:
    values = [
        {"source": "reverse cat dog:", "target": " dog cat"},
        {
            "messages": [
                {"role": "user", "content": "the bird?"},
                {"role": "assistant", "content": "it flew"},
            ]
        },
        {"segments": [{"text": "Q: "}, {"text": "the red cat", "elastic": True}], "target": " sat"},
    ]
    records = [parse_record("f.jsonl", i + 1, json.dumps(v)) for i, v in enumerate(values)]
    encoded = encode_records(tokenizer, records, sequence_length=64)
    _, pad_id = special_token_ids(tokenizer)
    batch = packed_rows([encoded, encoded[:1]], 64, pad_id)
    assert batch.target_tokens == sum(e.target_count for e in encoded) + encoded[0].target_count
    model = make_model().eval()
    with torch.no_grad():
        packed = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits
        unmasked = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        nll = objective_loss(model, batch)[0]
        alone_nll = torch.zeros(())
        at = 0
        for i, e in enumerate(encoded):
            k = len(e.ids) - 1
            inputs = torch.from_numpy(e.ids[:-1].astype(np.int64))[None]
            alone = model(input_ids=inputs).logits[0]
            torch.testing.assert_close(packed[0, at : at + k], alone, atol=1e-5, rtol=0)
            labels = batch.labels[0, at : at + k]
            assert labels.tolist() == np.where(e.loss_mask[1:], e.ids[1:], IGNORE_INDEX).tolist()
            alone_nll += F.cross_entropy(alone, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            if i > 0:  # position ids alone do not isolate records: the mask does
                assert (unmasked[0, at : at + k] - alone).abs().max() > 1e-3
            at += k
        alone_nll += F.cross_entropy(
            model(input_ids=batch.input_ids[1:, : len(encoded[0].ids) - 1]).logits[0],
            batch.labels[1, : len(encoded[0].ids) - 1],
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
    assert batch.labels[0, at:].eq(IGNORE_INDEX).all() and batch.input_ids[0, at:].eq(pad_id).all()
    assert nll.item() == pytest.approx(alone_nll.item(), rel=1e-5)


def test_records_packed_by_the_loader_compute_what_they_would_alone(
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_model: Callable[..., PreTrainedModel],
) -> None:
    data = load_phase_data(phase([make_pairs_file(records=20)], mbs=2, seq=64), tokenizer)
    _, pad_id = special_token_ids(tokenizer)
    model = make_model().eval()
    with torch.no_grad():
        for step in (1, 2):
            batch = batch_for_step(data, seed=0, phase_index=0, step=step, micro=0)
            packed = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
            ).logits
            spans = record_spans(batch, pad_id)
            assert len(spans) > 2 * batch.input_ids.shape[0]  # several records per row
            total = torch.zeros(())
            for r, start, end in spans:
                alone = model(input_ids=batch.input_ids[r : r + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[r, start:end], alone, atol=1e-5, rtol=0)
                total += F.cross_entropy(
                    alone, batch.labels[r, start:end], ignore_index=IGNORE_INDEX, reduction="sum"
                )
            nll, tokens = objective_loss(model, batch)
            assert nll.item() == pytest.approx(total.item(), rel=1e-5)
            assert tokens == batch.target_tokens


def test_each_record_is_packed_once_per_epoch(
    tokenizer: Tokenizer, make_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    words = ["cat", "dog", "bird", "mat", "tree"]
    rows = [{"source": f"{a} {b}:", "target": f" {b} {a}"} for a in words for b in words[:4]]
    path = make_jsonl(tmp_path / "unique.jsonl", rows)
    data = load_phase_data(phase([path], mbs=2, steps=30), tokenizer)
    _, pad_id = special_token_ids(tokenizer)
    counts: Counter[tuple[int, ...]] = Counter()
    for batch in batches(data, steps=30):
        for r, start, end in record_spans(batch, pad_id):
            counts[tuple(batch.input_ids[r, start:end].tolist())] += 1
    assert len(counts) == len(rows)  # every record seen
    assert max(counts.values()) - min(counts.values()) <= 1  # none twice before all once
    assert min(counts.values()) >= 2


# --- mixtures -------------------------------------------------------------------------------


def test_the_mixture_schedule_is_fixed_by_the_weights_and_interleaves_them_evenly() -> None:
    for weights in ([3.0, 1.0], [5.0, 3.0, 2.0], [0.1, 0.9], [1.0]):
        long = mixture_schedule(weights, 1000)
        assert mixture_schedule(weights, 100).tolist() == long[:100].tolist()
        shares = np.asarray(weights) / sum(weights)
        counts = np.cumsum(np.eye(len(weights))[long], axis=0)
        expected = np.arange(1, 1001)[:, None] * shares
        # Every prefix of the schedule is within a few microbatches of the planned shares.
        assert np.abs(counts - expected).max() <= 3


def test_realised_shares_of_the_loaded_mixture_follow_the_weights(
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
) -> None:
    sources = [
        {"path": str(make_pairs_file("a.jsonl", records=20, seed=1)), "weight": 5},
        {"path": str(make_pairs_file("b.jsonl", records=20, seed=2)), "weight": 3},
        {
            "path": str(make_text_file("c.jsonl", documents=30)),
            "weight": 2,
            "objective": "continued_pretrain",
            "sequence_length": 16,
            "microbatch_size": 8,
        },
    ]
    data = load_phase_data(phase(sources, steps=150, grad_accum=2), tokenizer)
    assert data.names() == ["a", "b", "c"]
    picked = [b.source for b in batches(data, steps=150)]
    assert picked == data.schedule.tolist()
    n = len(picked)
    for index, share in enumerate([0.5, 0.3, 0.2]):
        assert abs(picked.count(index) - share * n) <= 3, (index, picked.count(index))


def test_replay_batches_have_the_replay_geometry_and_its_text(
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
) -> None:
    replay = {
        "path": str(make_text_file("replay.jsonl")),
        "weight": 1,
        "objective": "continued_pretrain",
        "sequence_length": 16,
        "microbatch_size": 8,
    }
    sft = {"path": str(make_pairs_file()), "weight": 3}
    data = load_phase_data(phase([sft, replay], objective="summarization", steps=40), tokenizer)
    assert isinstance(data.sources[0], RecordSource)
    text = data.sources[1]
    assert isinstance(text, TextSource)
    assert (text.geometry.objective, text.geometry.sequence_length) == ("continued_pretrain", 16)
    flat = text.tokens.tolist()
    replayed = 0
    for batch in batches(data, steps=40):
        if batch.source == 0:
            assert batch.input_ids.shape == (4, 32) and batch.attention_mask is not None
            continue
        replayed += 1
        assert batch.input_ids.shape == (8, 16)
        assert batch.attention_mask is None and batch.position_ids is None
        assert batch.target_tokens == ENVELOPE
        for inputs, labels in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True):
            window = [*inputs, labels[-1]]
            assert labels == window[1:]
            assert any(flat[k * 16 : k * 16 + 17] == window for k in range(text.windows))
    assert abs(replayed - 10) <= 3


def all_tensors(batch: Batch) -> list[Any]:
    return [
        batch.input_ids,
        batch.labels,
        batch.attention_mask,
        batch.position_ids,
        batch.source,
        batch.target_tokens,
    ]


def assert_same_batch(a: Batch, b: Batch) -> None:
    for x, y in zip(all_tensors(a), all_tensors(b), strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y)
        else:
            assert x == y


@pytest.fixture
def mixed_phase(
    tokenizer: Tokenizer,
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
) -> Phase:
    replay = {
        "path": str(make_text_file("replay.jsonl", documents=40)),
        "objective": "continued_pretrain",
        "sequence_length": 16,
        "microbatch_size": 8,
    }
    return phase([make_pairs_file(records=30), replay], steps=40, grad_accum=2)


def test_batch_for_step_is_a_pure_function_of_its_arguments(
    tokenizer: Tokenizer, mixed_phase: Phase
) -> None:
    first = load_phase_data(mixed_phase, tokenizer)
    second = load_phase_data(mixed_phase, tokenizer)  # as in a fresh process: no state carried
    args = [(step, micro) for step in range(1, 41) for micro in (0, 1)]
    in_order = {
        a: batch_for_step(first, seed=3, phase_index=1, step=a[0], micro=a[1]) for a in args
    }
    # Resuming mid-phase, or drawing batches in any order, gives the same batches.
    for step, micro in reversed(args):
        again = batch_for_step(second, seed=3, phase_index=1, step=step, micro=micro)
        assert_same_batch(again, in_order[step, micro])
    assert_same_batch(
        batch_for_step(first, seed=3, phase_index=1, step=17, micro=1), in_order[17, 1]
    )
    assert len({tuple(b.input_ids.flatten().tolist()) for b in in_order.values()}) == len(args)


@pytest.mark.parametrize("source", [0, 1], ids=["records", "text"])
def test_the_seed_and_the_phase_index_change_the_order(
    tokenizer: Tokenizer, mixed_phase: Phase, source: int
) -> None:
    def first_of_source(seed: int, phase_index: int) -> torch.Tensor:
        data = load_phase_data(mixed_phase, tokenizer)  # a fresh load per order
        m = int(np.flatnonzero(data.schedule == source)[0])
        return batch_for_step(
            data, seed=seed, phase_index=phase_index, step=m // 2 + 1, micro=m % 2
        ).input_ids

    base = first_of_source(3, 1)
    assert not torch.equal(base, first_of_source(4, 1))
    assert not torch.equal(base, first_of_source(3, 0))


@pytest.mark.parametrize("source", [0, 1], ids=["records", "text"])
def test_a_batch_does_not_depend_on_batches_drawn_before_with_another_seed_or_phase(
    tokenizer: Tokenizer, mixed_phase: Phase, source: int
) -> None:
    used = load_phase_data(mixed_phase, tokenizer)
    m = int(np.flatnonzero(used.schedule == source)[0])
    at = {"step": m // 2 + 1, "micro": m % 2}
    batch_for_step(used, seed=3, phase_index=1, **at)  # warms whatever the data caches
    for args in ({"seed": 4, "phase_index": 1}, {"seed": 3, "phase_index": 0}):
        fresh = load_phase_data(mixed_phase, tokenizer)
        assert_same_batch(batch_for_step(used, **args, **at), batch_for_step(fresh, **args, **at))


def test_a_supervised_source_holds_its_records_as_the_one_encoder_encodes_them(
    tokenizer: Tokenizer, make_pairs_file: Callable[..., Path]
) -> None:
    path = make_pairs_file(records=7)
    data = load_phase_data(phase([path]), tokenizer)
    (source,) = data.sources
    assert isinstance(source, RecordSource)
    expected = encode_records(tokenizer, read_records(str(path)), sequence_length=32)
    stored = [source.record(i) for i in range(len(expected))]
    assert len(source.store) == len(expected)
    assert [e.ids.tolist() for e in stored] == [e.ids.tolist() for e in expected]
    assert [e.loss_mask.tolist() for e in stored] == [e.loss_mask.tolist() for e in expected]
    assert source.sizes.tolist() == [len(e.ids) - 1 for e in expected]
    assert data.reports == []  # no inspection gate, no report
    assert tokenizer.token_to_id(EOS_TOKEN) == int(stored[0].ids[-1])


def test_reading_and_encoding_a_corpus_is_progress_per_file_and_per_batch_of_records(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """Encoding a large corpus into its store takes minutes: each MiB hashed, each
    ENCODE_BATCH records encoded and each store opened tell the lease keeper the worker is not
    hung."""
    text = write_lines(tmp_path / "text.txt", ["the cat sat on the mat"] * (2 * ENCODE_BATCH + 1))
    calls: list[int] = []
    data = load_phase_data(
        phase([text], objective="continued_pretrain"),
        tokenizer,
        progress=lambda: calls.append(1),
    )
    # One MiB hashed, three batches of records encoded, the store opened.
    assert len(calls) == 1 + 3 + 1
    # Encoded in batches, the same tokens as in one.
    (source,) = data.sources
    assert isinstance(source, TextSource)
    whole = encode_records(tokenizer, read_records(str(text)), sequence_length=None)
    assert source.tokens.tolist() == np.concatenate([e.ids for e in whole]).tolist()
