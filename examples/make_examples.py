"""Regenerate the shipped example corpora and tokenizer (deterministic; seconds).

    python examples/make_examples.py

The corpora are synthetic but structured, so a tiny model learns them in a few hundred steps:
a small world of people, places and objects described in templated sentences. Every SFT task
puts what the target depends on *before* anything long, the lesson of the RAG incident in
shared/background/original-pr.md. The tokenizer is a byte-level BPE trained on the training
splits only, with the two special tokens the worker requires.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

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


TASKS: dict[str, Callable[[random.Random], dict[str, str]]] = {
    "pretrain": pretrain,
    "summarization": summarization,
    "instruction_tuning": instruction_tuning,
    "qa_reasoning": qa_reasoning,
    "retrieval_planning": retrieval_planning,
}
SIZES = {"train": 400, "eval": 48}


def write_corpora() -> list[Path]:
    train_files = []
    for task_index, (task, make) in enumerate(TASKS.items()):
        for split_index, (split, size) in enumerate(SIZES.items()):
            rng = random.Random(1000 * task_index + split_index)
            path = DATA / f"{task}.{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as f:
                for _ in range(size):
                    f.write(json.dumps(make(rng)) + "\n")
            if split == "train":
                train_files.append(path)
    return train_files


def write_tokenizer(train_files: list[Path]) -> None:
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
    TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(TOKENIZER))


if __name__ == "__main__":
    write_tokenizer(write_corpora())
    print(f"wrote {DATA} and {TOKENIZER}")
