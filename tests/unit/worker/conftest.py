"""Factories for the worker's unit tests: a tiny tokenizer, tiny data files, tiny workflows,
claims, and a reporter that records what would be posted to the service."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from contracts.reports import CheckpointRef, Claim, EvalResult, RemovalStatus
from contracts.signature import Digests, sha256_path
from contracts.workflow import ENCODER_VERSION, Workflow
from worker.checkpoint.layout import verify_checkpoint
from worker.data import store as store_module
from worker.link.reporter import Action

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Two xdist processes share two cores.
torch.set_num_threads(1)

_VOCABULARY = (
    "the a cat dog bird sat ran flew on over under mat tree roof quickly slowly "
    "and then it was red blue green small big"
)
WORDS = _VOCABULARY.split()
SEQUENCE_LENGTH = 32
MICROBATCH_SIZE = 4

TINY_MODEL: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def sentence(rng: random.Random, words: int = 8) -> str:
    # A learnable pattern: a fixed subject-verb-object skeleton with random fillers.
    parts = []
    for _ in range(words // 4):
        parts += ["the", rng.choice(WORDS[2:5]), rng.choice(WORDS[5:8]), rng.choice(WORDS[8:11])]
    return " ".join(parts)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer of ~300 tokens with trainctl's special tokens."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(500)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|pad|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture
def tokenizer(tokenizer_path: Path) -> Tokenizer:
    from worker.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path)


def write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def make_jsonl() -> Callable[[Path, Sequence[Mapping[str, Any]]], Path]:
    return write_jsonl


@pytest.fixture
def make_text_file(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "pretrain.jsonl", *, documents: int = 200, seed: int = 0) -> Path:
        rng = random.Random(seed)
        return write_jsonl(
            tmp_path / "data" / name, [{"text": sentence(rng, 12)} for _ in range(documents)]
        )

    return make


@pytest.fixture
def make_pairs_file(tmp_path: Path) -> Callable[..., Path]:
    """Supervised records whose target is a deterministic function of the source."""

    def make(name: str = "sft.jsonl", *, records: int = 100, seed: int = 0) -> Path:
        rng = random.Random(seed)
        rows = []
        for _ in range(records):
            words = [rng.choice(WORDS[2:8]) for _ in range(3)]
            rows.append(
                {"source": "reverse " + " ".join(words) + ":", "target": " ".join(words[::-1])}
            )
        return write_jsonl(tmp_path / "data" / name, rows)

    return make


@pytest.fixture
def make_zst() -> Callable[[Path], Path]:
    """Compress a file to a sibling `<name>.zst` (the original is kept)."""

    def make(path: Path) -> Path:
        import zstandard

        out = path.with_name(path.name + ".zst")
        out.write_bytes(zstandard.ZstdCompressor().compress(path.read_bytes()))
        return out

    return make


@pytest.fixture
def make_model() -> Callable[..., PreTrainedModel]:
    """A tiny llama (TINY_MODEL with `overrides`), its weights fixed by `seed`, in train mode."""

    def make(*, seed: int = 0, **overrides: Any) -> PreTrainedModel:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = {**TINY_MODEL, **overrides}
        model_type = config.pop("model_type")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
        return model.train()

    return make


@pytest.fixture
def make_workflow(tokenizer_path: Path) -> Callable[..., Workflow]:
    def make(
        phases: Sequence[Mapping[str, Any]],
        *,
        evals: Sequence[Mapping[str, Any]] = (),
        model: Mapping[str, Any] | None = None,
        checkpoint: Mapping[str, Any] | None = None,
        optimizer: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> Workflow:
        full_phases = [
            {
                "sequence_length": SEQUENCE_LENGTH,
                "microbatch_size": MICROBATCH_SIZE,
                **p,
                "data": [{"path": str(d)} if isinstance(d, Path) else d for d in p["data"]],
            }
            for p in phases
        ]
        return Workflow.model_validate(
            {
                "name": "test",
                "model": {"config": {**TINY_MODEL, **(model or {})}},
                "tokenizer": str(tokenizer_path),
                "seed": seed,
                "microbatch_tokens": SEQUENCE_LENGTH * MICROBATCH_SIZE,
                "optimizer": optimizer or {},
                "checkpoint": checkpoint or {"every_steps": 100, "keep_last": 2},
                "evals": [{**e, "data": str(e["data"])} for e in evals],
                "phases": full_phases,
            }
        )

    return make


def digests_of(workflow: Workflow) -> Digests:
    return Digests(
        tokenizer=sha256_path(workflow.tokenizer),
        data={path: sha256_path(path) for path in workflow.data_paths()},
    )


@pytest.fixture
def make_claim(tmp_path: Path) -> Callable[..., Claim]:
    def make(
        workflow: Workflow,
        *,
        phase_index: int = 0,
        resume_from: CheckpointRef | None = None,
        artifact_dir: Path | None = None,
        signature: str = "signature-of-test-run",
        initial_checkpoint: str | None = None,
    ) -> Claim:
        return Claim(
            attempt_id="attempt-1",
            run_id="run-1",
            attempt_number=1,
            fencing_token="claim-secret-7",
            lease_seconds=60.0,
            workflow=workflow.normalized(),
            signature=signature,
            digests=digests_of(workflow),
            initial_checkpoint=initial_checkpoint,
            phase_index=phase_index,
            resume_from=resume_from,
            artifact_dir=str(artifact_dir or tmp_path / "artifacts" / "runs" / "run"),
            encoder_version=ENCODER_VERSION,
        )

    return make


class RecordingReporter:
    """Records what the trainer would post to the service. A checkpoint is verified at the
    moment it is reported: the service must only ever hear of complete checkpoints."""

    def __init__(
        self,
        stop_at: int | None = None,
        pause_at: int | None = None,
        pinned: Sequence[int] = (),
        refused: Sequence[int] = (),
    ) -> None:
        self.stop_at = stop_at
        self.pause_at = pause_at
        self.pinned = frozenset(pinned)  # what every registration's answer says is pinned
        # Deletions the service refuses (409 `checkpoint_pinned`: a run was created from the
        # checkpoint after the registration's answer).
        self.refused = frozenset(refused)
        self.unreachable = False  # removals are spooled, not yet recorded by the service
        self.metrics_by_step: dict[int, dict[str, float]] = {}
        self.eval_results: list[EvalResult] = []
        self.checkpoints: list[CheckpointRef] = []
        self.removals: list[tuple[int, str, str]] = []  # (step, status, reason)
        # Units of work that report nothing else (preparation stages, eval sets): what the
        # lease keeper's heartbeats show the service to judge a stall.
        self.progress_calls = 0
        self.prepared: list[tuple[str, float]] = []  # (file, fraction) as stores were built
        self.checks: list[tuple[int, bool]] = []  # (step, now): now is a fencing check

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        assert step not in self.metrics_by_step, f"metrics of step {step} reported twice"
        self.metrics_by_step[step] = dict(values)

    def evals(self, results: Sequence[EvalResult]) -> None:
        self.eval_results.extend(results)

    def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
        verify_checkpoint(Path(ref.path))
        self.checkpoints.append(ref)
        return self.pinned

    def checkpoint_removed(self, step: int, status: RemovalStatus, reason: str) -> bool:
        self.removals.append((step, status, reason))
        return not self.unreachable and not (status == "deleted" and step in self.refused)

    def progress(self) -> None:
        self.progress_calls += 1

    def preparing(self, file: str, fraction: float) -> None:
        self.prepared.append((file, fraction))

    def check(self, step: int, *, now: bool = False) -> Action:
        self.checks.append((step, now))
        if self.stop_at is not None and step >= self.stop_at:
            return "stop"
        if self.pause_at is not None and step >= self.pause_at:
            return "pause"
        return "continue"


@pytest.fixture
def make_reporter() -> type[RecordingReporter]:
    return RecordingReporter


@pytest.fixture
def claim(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
) -> Claim:
    """The claim of a one-phase pretraining run of 9 steps: what the reporter tests report on."""
    phase = {"name": "p", "objective": "continued_pretrain", "data": [make_text_file()], "steps": 9}
    return make_claim(make_workflow([phase]))


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the token stores built (encoded, not merely opened or downloaded) while a
    test runs."""
    built: list[str] = []
    real = store_module._build

    def counting(path: str, *args: Any, **kwargs: Any) -> None:
        built.append(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(store_module, "_build", counting)
    return built
