"""Regenerate the shipped example corpora and tokenizer (deterministic; seconds).

    python examples/make_examples.py [--out DIR]    # DIR/data, DIR/tokenizer; default examples/

The corpora are synthetic but structured, so a tiny model learns them in a few hundred steps:
a small world of people, places and objects described in templated sentences. Every SFT task
puts what the target depends on *before* anything long: truncating RAG records from the end
once cost a third of a corpus its question (docs/data.md). The tokenizer is a byte-level BPE
trained on the training splits of the five original tasks only, with the two special tokens
the worker requires.

The post-training corpora of workflows/sft.example.json are written with the words that
tokenizer knows (adding them to its training text would change it, and every length below):

- qa_rag: segmented RAG records, the question first (never elastic), then ranked passages
  (elastic), then the cue to answer, as the PR's fixed data puts the question before the
  passages. At sequence_length 64 over a quarter need passages dropped or trimmed (the one
  holding the answer goes in about 3 % of records: dropping last-first spares the top-ranked
  passage, not the right one); a few eval records are too long even with every passage gone
  (`oversized_records`);
- chat: system/user/assistant conversations, some multi-turn, all within sequence_length 64;
- pretrain.replay.txt.zst: the pretraining training text as zstd-compressed plain text, one
  document a line, replayed inside the SFT phases.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
TOKENIZER = HERE / "tokenizer" / "tokenizer.json"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>"]

PEOPLE = ["ada", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu"]
PLACES = ["the mill", "the harbor", "the market", "the school", "the tower", "the garden"]
OBJECTS = ["a lamp", "a map", "a key", "a book", "a rope", "a coin", "a bell", "a cup"]
VERBS = ["found", "sold", "fixed", "painted", "carried", "hid", "lost", "bought"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
COLORS = ["red", "blue", "green", "black", "white", "gold"]


def fact(rng: random.Random) -> dict[str, str]:
    return {
        "who": rng.choice(PEOPLE),
        "verb": rng.choice(VERBS),
        "what": rng.choice(OBJECTS),
        "where": rng.choice(PLACES),
        "day": rng.choice(DAYS),
        "color": rng.choice(COLORS),
    }


def sentence(f: dict[str, str]) -> str:
    return f"on {f['day']} {f['who']} {f['verb']} {f['what']} at {f['where']}."


def detail(f: dict[str, str]) -> str:
    return f"{f['what'].split()[1]} was {f['color']} and {f['who']} went home after."


def pretrain(rng: random.Random) -> dict[str, str]:
    facts = [fact(rng) for _ in range(rng.randint(2, 4))]
    return {"text": " ".join(f"{sentence(f)} the {detail(f)}" for f in facts)}


def summarization(rng: random.Random) -> dict[str, str]:
    f = fact(rng)
    filler = [sentence(fact(rng)) for _ in range(2)]
    source = f"summarize: {sentence(f)} the {detail(f)} " + " ".join(filler) + " summary:"
    return {"source": source, "target": f" {f['who']} {f['verb']} {f['what']}."}


def instruction_tuning(rng: random.Random) -> dict[str, str]:
    people = rng.sample(PEOPLE, 3)
    kind = rng.choice(["reverse", "first", "count"])
    if kind == "reverse":
        source = f"instruction: list these names in reverse order: {', '.join(people)}. answer:"
        target = " " + ", ".join(reversed(people)) + "."
    elif kind == "first":
        source = f"instruction: name the first person in: {', '.join(people)}. answer:"
        target = f" {people[0]}."
    else:
        source = f"instruction: how many names are in: {', '.join(people)}? answer:"
        target = " three."
    return {"source": source, "target": target}


def qa_reasoning(rng: random.Random) -> dict[str, str]:
    f = fact(rng)
    passages = [sentence(fact(rng)) for _ in range(2)] + [sentence(f)]
    rng.shuffle(passages)
    # The question comes first: truncating passages can never remove it.
    source = (
        f"question: what did {f['who']} do on {f['day']}? passages: {' '.join(passages)} answer:"
    )
    return {"source": source, "target": f" {f['who']} {f['verb']} {f['what']} at {f['where']}."}


def retrieval_planning(rng: random.Random) -> dict[str, str]:
    f = fact(rng)
    source = f"goal: find out where {f['who']} {f['verb']} {f['what']}. plan:"
    target = (
        f" 1. search for {f['who']} and {f['what']}. 2. read the notes from {f['day']}."
        f" 3. answer with the place."
    )
    return {"source": source, "target": target}


def passage(f: dict[str, str], *, detailed: bool) -> str:
    text = f" passage: {sentence(f)}"
    return f"{text} the {detail(f)}" if detailed else text


def qa_rag(rng: random.Random, *, long_question_share: float = 0.0) -> dict[str, Any]:
    """The question first, as the PR's regenerated RAG data has it, then the passages as a
    retriever returns them (the best one usually first), then the cue to answer. Passages are
    elastic, so the encoder drops or trims them, last first, to fit; the question, the cue and
    the target never shrink, and an encoder that cut from the tail would lose passages, never
    the question. With `long_question_share`, that share of records gets a question too long
    for sequence_length 64 on its own."""
    f = fact(rng)
    # A passage about the same person on another day, so the day in the question matters.
    distractors = [{**fact(rng), "who": f["who"]}] + [fact(rng) for _ in range(rng.randint(0, 1))]
    distractors = [d for d in distractors if (d["who"], d["day"]) != (f["who"], f["day"])]
    rng.shuffle(distractors)
    rank = 0 if not distractors or rng.random() < 0.7 else rng.randint(1, len(distractors))
    ask_color = rng.random() < 0.3
    passages = [
        {
            "text": passage(p, detailed=(p is f and ask_color) or rng.random() < 0.2),
            "role": "passage",
            "elastic": rng.choice(["drop", "end"]),
        }
        for p in [*distractors[:rank], f, *distractors[rank:]]
    ]
    obj = f["what"].split()[1]
    if ask_color:
        question = f"what was the {obj} {f['who']} {f['verb']} on {f['day']}?"
        target = f" the {obj} was {f['color']}."
    else:
        question = f"what did {f['who']} do on {f['day']}?"
        target = f" {f['who']} {f['verb']} {f['what']} at {f['where']}."
    if rng.random() < long_question_share:
        question = (
            f"from these names: {', '.join(PEOPLE)}; and these places: {', '.join(PLACES)}; "
            + question
        )
    segments = [
        {"text": f"question: {question}", "role": "question"},
        *passages,
        {"text": " answer:", "role": "cue"},
    ]
    return {"segments": segments, "target": target}


def qa_rag_eval(rng: random.Random) -> dict[str, Any]:
    return qa_rag(rng, long_question_share=0.125)


def chat(rng: random.Random) -> dict[str, Any]:
    """A conversation whose assistant turns are the targets; half of them are multi-turn."""
    people = rng.sample(PEOPLE, 3)
    names = ", ".join(people)
    reverse = ", ".join(reversed(people)) + "."
    kind = rng.choice(["reverse", "place", "count_then_reverse", "first_then_first"])
    if kind == "reverse":
        turns = [
            ("system", "list the names in reverse order."),
            ("user", names),
            ("assistant", reverse),
        ]
    elif kind == "place":
        f = fact(rng)
        turns = [
            ("system", "answer with the place."),
            ("user", f"{sentence(f)} where was the {f['what'].split()[1]}?"),
            ("assistant", f"at {f['where']}."),
        ]
    elif kind == "count_then_reverse":
        turns = [
            ("user", f"how many names are in: {names}?"),
            ("assistant", "three."),
            ("user", "list these names in reverse order."),
            ("assistant", reverse),
        ]
    else:
        others = rng.sample([p for p in PEOPLE if p not in people], 3)
        turns = [
            ("system", "answer with the first name."),
            ("user", names),
            ("assistant", f"{people[0]}."),
            ("user", ", ".join(others)),
            ("assistant", f"{others[0]}."),
        ]
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


Maker = Callable[[random.Random], dict[str, Any]]
# The tokenizer is trained on these tasks' training splits.
TASKS: dict[str, Maker] = {
    "pretrain": pretrain,
    "summarization": summarization,
    "instruction_tuning": instruction_tuning,
    "qa_reasoning": qa_reasoning,
    "retrieval_planning": retrieval_planning,
}
SIZES = {"train": 400, "eval": 48}
# Post-training corpora, a maker per split, seeded after TASKS: appending one changes no file.
POST_TRAINING: dict[str, dict[str, Maker]] = {
    "qa_rag": {"train": qa_rag, "eval": qa_rag_eval},
    "chat": {"train": chat, "eval": chat},
}
REPLAY = "pretrain.replay.txt.zst"
# Fixed level, single-threaded, no checksum: the same bytes on every run (with one zstd version).
ZSTD_LEVEL = 19


def _write_jsonl(path: Path, make: Maker, rng: random.Random, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(size):
            f.write(json.dumps(make(rng)) + "\n")


def write_corpora(data: Path = DATA) -> list[Path]:
    """Write every corpus under `data`; return the training files the tokenizer learns from."""
    train_files = []
    for task_index, (task, make) in enumerate(TASKS.items()):
        for split_index, (split, size) in enumerate(SIZES.items()):
            path = data / f"{task}.{split}.jsonl"
            _write_jsonl(path, make, random.Random(1000 * task_index + split_index), size)
            if split == "train":
                train_files.append(path)
    for task_index, (task, makers) in enumerate(POST_TRAINING.items(), start=len(TASKS)):
        for split_index, (split, size) in enumerate(SIZES.items()):
            rng = random.Random(1000 * task_index + split_index)
            _write_jsonl(data / f"{task}.{split}.jsonl", makers[split], rng, size)
    write_replay(data / "pretrain.train.jsonl", data / REPLAY)
    return train_files


def write_replay(source: Path, path: Path) -> None:
    """The texts of a {"text"} JSONL file as zstd-compressed plain text, one document a line."""
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False, threads=0)
    path.write_bytes(compressor.compress("".join(t + "\n" for t in texts).encode()))


def write_tokenizer(train_files: list[Path], path: Path = TOKENIZER) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> list[str]:
        out: list[str] = []
        for path in train_files:
            for line in path.read_text().splitlines():
                record = json.loads(line)
                out.extend(str(v) for v in record.values())
        return out

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE,
        help="write DIR/data and DIR/tokenizer (default: %(default)s)",
    )
    out = parser.parse_args(argv).out
    data, tokenizer = out / "data", out / "tokenizer" / "tokenizer.json"
    write_tokenizer(write_corpora(data), tokenizer)
    print(f"wrote {data} and {tokenizer}")


if __name__ == "__main__":
    main()
