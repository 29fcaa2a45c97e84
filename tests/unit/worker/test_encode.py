"""The one encoder: exact ids and loss masks per record format, and overflow found by measuring."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from worker.data.encode import Encoded, encode_record, encode_records
from worker.data.records import Record, parse_record
from worker.data.tokenizer import EOS_TOKEN

INSTRUCTION = "Answer from the passages.\n"
FIRST = " the cat sat on the mat and then it ran"
SECOND = " the dog ran over the tree quickly"
QUESTION = "\nWhere did the dog run?"
ANSWER = " over the tree"


def record(value: dict[str, Any], *, line: int = 1) -> Record:
    return parse_record("data.jsonl", line, json.dumps(value))


def toks(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def eos(tokenizer: Tokenizer) -> int:
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    assert eos_id is not None
    return eos_id


def targets(encoded: Encoded) -> list[bool]:
    return encoded.loss_mask.tolist()


def rag(*middle: dict[str, Any], target: str = ANSWER) -> Record:
    """A RAG-style record: instruction, `middle` segments, question; then the target."""
    return record(
        {
            "segments": [
                {"text": INSTRUCTION, "role": "instruction"},
                *middle,
                {"text": QUESTION, "role": "question"},
            ],
            "target": target,
        }
    )


# --- formats --------------------------------------------------------------------------------


def test_text_is_its_tokens_then_eos_and_never_refused(tokenizer: Tokenizer) -> None:
    text = "the cat sat on the mat " * 20
    encoded = encode_record(tokenizer, record({"text": text}), sequence_length=4)
    body = toks(tokenizer, text)
    assert encoded.ids.dtype == np.int32
    assert encoded.ids.tolist() == [*body, eos(tokenizer)]
    assert encoded.target_count == len(body)  # every token after the first, the EOS included
    report = encoded.report
    assert (report.kind, report.part_tokens, report.source_tokens) == ("text", (len(body),), 0)
    assert (report.target_tokens, report.total_tokens) == (len(body), len(body) + 1)
    assert report.fits and report.reason is None and encoded.usable


def test_a_pair_trains_the_target_and_its_eos_only(tokenizer: Tokenizer) -> None:
    encoded = encode_record(
        tokenizer, record({"source": "reverse cat dog:", "target": " dog cat"}), sequence_length=32
    )
    source, target = toks(tokenizer, "reverse cat dog:"), toks(tokenizer, " dog cat")
    assert encoded.ids.tolist() == [*source, *target, eos(tokenizer)]
    assert targets(encoded) == [False] * len(source) + [True] * (len(target) + 1)
    assert encoded.target_count == len(target) + 1
    report = encoded.report
    assert report.kind == "pair"
    assert report.part_tokens == (len(source),)
    assert (report.source_tokens, report.target_tokens) == (len(source), len(target))
    assert report.total_tokens == len(source) + len(target) + 1
    assert report.fits and report.reason is None and not report.zero_target
    assert report.dropped_segments == report.trimmed_segments == ()
    assert encoded.usable


def test_a_chat_trains_only_assistant_content_and_its_eos(tokenizer: Tokenizer) -> None:
    messages = [
        ("system", "Be brief."),
        ("user", "the cat?"),
        ("assistant", "the dog"),
        ("user", "and then?"),
        ("assistant", "a small bird"),
    ]
    encoded = encode_record(
        tokenizer,
        record({"messages": [{"role": r, "content": c} for r, c in messages]}),
        sequence_length=128,
    )
    # Context is "<role>: <content>\n"; an assistant turn is "assistant:", then " <content>"
    # and EOS, the targets.
    ids: list[int] = []
    mask: list[bool] = []
    part_tokens = []
    for role, content in messages:
        if role == "assistant":
            head, body = toks(tokenizer, "assistant:"), toks(tokenizer, f" {content}")
            ids += [*head, *body, eos(tokenizer)]
            mask += [False] * len(head) + [True] * (len(body) + 1)
            part_tokens.append(len(head) + len(body) + 1)
        else:
            context = toks(tokenizer, f"{role}: {content}\n")
            ids += context
            mask += [False] * len(context)
            part_tokens.append(len(context))
    assert encoded.ids.tolist() == ids
    assert targets(encoded) == mask
    answers = len(toks(tokenizer, " the dog")) + len(toks(tokenizer, " a small bird"))
    assert encoded.target_count == answers + 2
    report = encoded.report
    assert report.kind == "chat"
    assert report.part_tokens == tuple(part_tokens)
    assert report.target_tokens == answers  # without each turn's EOS
    assert report.source_tokens + report.target_tokens + 2 == report.total_tokens == len(ids)
    assert report.fits and encoded.usable


def test_segments_in_order_then_target_train_the_target_and_eos_only(tokenizer: Tokenizer) -> None:
    encoded = encode_record(
        tokenizer, rag({"text": FIRST, "role": "passage", "elastic": True}), sequence_length=128
    )
    parts = [toks(tokenizer, t) for t in (INSTRUCTION, FIRST, QUESTION)]
    answer = toks(tokenizer, ANSWER)
    prompt = [t for p in parts for t in p]
    assert encoded.ids.tolist() == [*prompt, *answer, eos(tokenizer)]
    assert targets(encoded) == [False] * len(prompt) + [True] * (len(answer) + 1)
    report = encoded.report
    assert report.kind == "segmented"
    assert report.part_tokens == tuple(len(p) for p in parts)
    assert (report.source_tokens, report.target_tokens) == (len(prompt), len(answer))
    assert report.total_tokens == len(prompt) + len(answer) + 1
    assert report.dropped_segments == report.trimmed_segments == ()
    assert report.tokens_trimmed == 0 and report.fits and encoded.usable


@pytest.mark.parametrize(
    "value",
    [
        {"text": "the cat sat"},
        {"source": "the cat", "target": " sat"},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"segments": [{"text": "the cat"}], "target": " sat"},
    ],
    ids=["text", "pair", "chat", "segmented"],
)
def test_the_first_id_is_never_a_target(tokenizer: Tokenizer, value: dict[str, Any]) -> None:
    # Nothing precedes ids[0], so nothing predicts it (Encoded.loss_mask's contract).
    encoded = encode_record(tokenizer, record(value), sequence_length=64)
    assert not encoded.loss_mask[0]
    assert encoded.target_count == int(encoded.loss_mask.sum())


def test_a_batch_encodes_each_record_as_it_would_alone(tokenizer: Tokenizer) -> None:
    records = [
        record({"text": "the cat"}),
        record({"source": "a", "target": " b"}),
        rag({"text": FIRST, "elastic": True}),
        record({"messages": [{"role": "assistant", "content": "the dog"}]}),
    ]
    together = encode_records(tokenizer, records, sequence_length=24)
    for r, encoded in zip(records, together, strict=True):
        alone = encode_record(tokenizer, r, sequence_length=24)
        assert encoded.ids.tolist() == alone.ids.tolist()
        assert encoded.loss_mask.tolist() == alone.loss_mask.tolist()
        assert encoded.report == alone.report


# --- overflow -------------------------------------------------------------------------------


def test_a_pair_too_long_is_measured_and_reported_never_truncated(tokenizer: Tokenizer) -> None:
    source, target = "the cat sat on the mat " * 6, " the dog"
    full = encode_record(
        tokenizer, record({"source": source, "target": target}), sequence_length=None
    )
    n = len(full.ids)
    prompt, answer = len(toks(tokenizer, source)), len(toks(tokenizer, target)) + 1
    assert full.report.fits and full.report.reason is None  # None: measuring only

    fits = encode_record(
        tokenizer, record({"source": source, "target": target}), sequence_length=n - 1
    )
    assert fits.report.fits and fits.usable  # n ids fill a row of n - 1 positions exactly

    long = encode_record(
        tokenizer, record({"source": source, "target": target}), sequence_length=n - 2
    )
    assert not long.report.fits and not long.usable
    assert long.report.reason == (
        f"encodes to {n} tokens (prompt {prompt} + target and EOS {answer}), "
        f"more than sequence_length + 1 = {n - 1}"
    )
    assert long.ids.tolist() == full.ids.tolist()  # whole: measured, not cut
    assert long.loss_mask.tolist() == full.loss_mask.tolist()
    assert long.report.total_tokens == n


def test_a_chat_too_long_is_refused_whole(tokenizer: Tokenizer) -> None:
    value = {
        "messages": [
            {"role": "user", "content": "the cat sat on the mat " * 4},
            {"role": "assistant", "content": "the dog"},
        ]
    }
    full = encode_record(tokenizer, record(value), sequence_length=None)
    long = encode_record(tokenizer, record(value), sequence_length=len(full.ids) - 2)
    assert not long.report.fits and not long.usable
    assert f"encodes to {len(full.ids)} tokens" in (long.report.reason or "")
    assert long.ids.tolist() == full.ids.tolist()


def fitted(tokenizer: Tokenizer, r: Record, *, overflow: int) -> tuple[Encoded, list[int]]:
    """`r` encoded at the sequence_length that leaves it `overflow` tokens too long, and the ids
    it has unfitted."""
    full = encode_record(tokenizer, r, sequence_length=None)
    seq = len(full.ids) - 1 - overflow
    return encode_record(tokenizer, r, sequence_length=seq), full.ids.tolist()


def test_elastic_segments_are_dropped_last_first(tokenizer: Tokenizer) -> None:
    first, second = (toks(tokenizer, t) for t in (FIRST, SECOND))
    instruction, question = toks(tokenizer, INSTRUCTION), toks(tokenizer, QUESTION)
    tail = [*toks(tokenizer, ANSWER), eos(tokenizer)]
    r = rag({"text": FIRST, "elastic": "drop"}, {"text": SECOND, "elastic": True})

    one, full = fitted(tokenizer, r, overflow=1)  # dropping the last passage is enough
    assert one.ids.tolist() == [*instruction, *first, *question, *tail]
    assert one.report.dropped_segments == (2,)
    assert one.report.trimmed_segments == ()
    assert one.report.tokens_trimmed == len(second)
    assert one.report.fits and one.usable and one.report.reason is None
    # Lengths are of the record as encoded, before fitting.
    assert one.report.total_tokens == len(full)
    assert one.report.part_tokens == (len(instruction), len(first), len(second), len(question))
    assert one.report.source_tokens == len(full) - len(tail)
    assert targets(one) == [False] * (len(one.ids) - len(tail)) + [True] * len(tail)

    both, _ = fitted(tokenizer, r, overflow=len(second) + 1)
    assert both.ids.tolist() == [*instruction, *question, *tail]
    assert both.report.dropped_segments == (1, 2)
    assert both.report.tokens_trimmed == len(first) + len(second)
    assert both.usable


def test_the_last_elastic_segment_goes_first_wherever_the_question_is(
    tokenizer: Tokenizer,
) -> None:
    r = record(
        {
            "segments": [
                {"text": FIRST, "elastic": True},
                {"text": QUESTION, "role": "question"},
                {"text": SECOND, "elastic": True},
            ],
            "target": ANSWER,
        }
    )
    encoded, _ = fitted(tokenizer, r, overflow=1)
    answer = [*toks(tokenizer, ANSWER), eos(tokenizer)]
    assert encoded.ids.tolist() == [*toks(tokenizer, FIRST), *toks(tokenizer, QUESTION), *answer]
    assert encoded.report.dropped_segments == (2,)


@pytest.mark.parametrize("side", ["start", "end"])
def test_an_elastic_segment_is_trimmed_from_its_declared_side(
    tokenizer: Tokenizer, side: str
) -> None:
    passage = toks(tokenizer, FIRST)
    r = rag({"text": FIRST, "role": "passage", "elastic": side})
    encoded, _ = fitted(tokenizer, r, overflow=3)
    kept = passage[3:] if side == "start" else passage[:-3]
    answer = [*toks(tokenizer, ANSWER), eos(tokenizer)]
    assert encoded.ids.tolist() == [
        *toks(tokenizer, INSTRUCTION),
        *kept,
        *toks(tokenizer, QUESTION),
        *answer,
    ]
    assert encoded.report.trimmed_segments == (1,)
    assert encoded.report.dropped_segments == ()
    assert encoded.report.tokens_trimmed == 3
    assert encoded.report.fits and encoded.usable
    assert targets(encoded)[-len(answer) :] == [True] * len(answer)
    assert not any(targets(encoded)[: -len(answer)])


def test_a_trimmable_segment_shorter_than_the_overflow_is_dropped_then_the_next_trimmed(
    tokenizer: Tokenizer,
) -> None:
    first, second = toks(tokenizer, FIRST), toks(tokenizer, SECOND)
    r = rag({"text": FIRST, "elastic": "end"}, {"text": SECOND, "elastic": "start"})
    encoded, _ = fitted(tokenizer, r, overflow=len(second) + 2)
    answer = [*toks(tokenizer, ANSWER), eos(tokenizer)]
    assert encoded.ids.tolist() == [
        *toks(tokenizer, INSTRUCTION),
        *first[:-2],
        *toks(tokenizer, QUESTION),
        *answer,
    ]
    assert encoded.report.dropped_segments == (2,)
    assert encoded.report.trimmed_segments == (1,)
    assert encoded.report.tokens_trimmed == len(second) + 2


def test_elastic_true_drops_the_segment_whole_even_when_trimming_would_do(
    tokenizer: Tokenizer,
) -> None:
    encoded, _ = fitted(tokenizer, rag({"text": FIRST, "elastic": True}), overflow=1)
    assert encoded.report.dropped_segments == (1,)
    assert encoded.report.tokens_trimmed == len(toks(tokenizer, FIRST))


def test_a_record_too_long_without_its_elastic_segments_is_refused_keeping_the_rest_intact(
    tokenizer: Tokenizer,
) -> None:
    first = toks(tokenizer, FIRST)
    instruction, question = toks(tokenizer, INSTRUCTION), toks(tokenizer, QUESTION)
    answer = [*toks(tokenizer, ANSWER), eos(tokenizer)]
    r = rag({"text": FIRST, "elastic": "end"})
    encoded, full = fitted(tokenizer, r, overflow=len(first) + 1)
    rest = len(instruction) + len(question) + len(answer)
    assert not encoded.report.fits and not encoded.usable
    assert encoded.report.reason == (
        f"encodes to {rest} tokens (prompt {len(instruction) + len(question)} + target and EOS "
        f"{len(answer)}), more than sequence_length + 1 = {len(full) - len(first) - 1}"
    )
    # Neither the instruction, the question nor the target was touched.
    assert encoded.ids.tolist() == [*instruction, *question, *answer]
    assert encoded.report.total_tokens == len(full)


def test_a_record_without_elastic_segments_is_never_fitted(tokenizer: Tokenizer) -> None:
    r = record({"segments": [{"text": INSTRUCTION}, {"text": FIRST}], "target": ANSWER})
    encoded, full = fitted(tokenizer, r, overflow=1)
    assert not encoded.report.fits
    assert encoded.ids.tolist() == full
    assert encoded.report.dropped_segments == encoded.report.trimmed_segments == ()


def test_without_a_sequence_length_nothing_is_fitted(tokenizer: Tokenizer) -> None:
    r = rag({"text": FIRST * 5, "elastic": True})
    encoded = encode_record(tokenizer, r, sequence_length=None)
    assert encoded.report.dropped_segments == ()
    assert encoded.report.fits


# --- zero targets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"source": "the cat", "target": ""},
        {"segments": [{"text": "the cat"}], "target": ""},
        {"messages": [{"role": "user", "content": "the cat"}]},
        {
            "messages": [
                {"role": "user", "content": "the cat"},
                {"role": "assistant", "content": ""},
            ]
        },
    ],
    ids=["pair", "segmented", "chat-without-assistant", "chat-empty-assistant"],
)
def test_an_empty_target_is_reported_as_zero_target_not_trained_silently(
    tokenizer: Tokenizer, value: dict[str, Any]
) -> None:
    encoded = encode_record(tokenizer, record(value), sequence_length=64)
    assert encoded.report.zero_target
    assert encoded.report.target_tokens == 0
    assert encoded.report.fits  # it fits; it just trains nothing
    assert not encoded.usable
    assert encoded.report.reason is not None and "no target tokens" in encoded.report.reason


def test_special_token_strings_in_data_are_text_not_control_tokens(tokenizer: Tokenizer) -> None:
    """Scraped text quotes "<|endoftext|>": it must not become a document boundary inside a
    prompt, and "<|pad|>" must never be a target."""
    pad = tokenizer.token_to_id("<|pad|>")
    value = {"source": "q <|endoftext|> x", "target": " a <|pad|> b"}
    encoded = encode_record(tokenizer, record(value), sequence_length=None)
    ids = encoded.ids.tolist()
    assert ids.count(eos(tokenizer)) == 1 and ids[-1] == eos(tokenizer)
    assert pad not in ids
    text = encode_record(tokenizer, record({"text": "a <|endoftext|> b"}), sequence_length=None)
    assert text.ids.tolist().count(eos(tokenizer)) == 1


def test_a_target_whose_only_token_opens_the_record_trains_nothing(tokenizer: Tokenizer) -> None:
    """With an empty source, the target's first token is predicted by nothing: a one-token
    target would train only the EOS, so it has no target tokens."""
    assert len(toks(tokenizer, "a")) == 1
    encoded = encode_record(tokenizer, record({"source": "", "target": "a"}), sequence_length=None)
    assert encoded.report.zero_target and not encoded.usable
    longer = encode_record(
        tokenizer, record({"source": "", "target": " cat dog"}), sequence_length=None
    )
    assert longer.report.target_tokens == len(toks(tokenizer, " cat dog")) - 1
