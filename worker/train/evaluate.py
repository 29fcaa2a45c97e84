"""Per-task evaluation: token-weighted, target-only cross-entropy over a whole eval file.

Records go through the one encoder (worker.data.encode, read from the token store that
training reads) and the loss through the one objective (worker.train.objective), so an eval
number is the training loss without gradients. A held-out record never takes a run down: one
that cannot be scored is skipped and counted, too long in `oversized_records`, the others by
reason in `skipped_records` (a line that is not JSON, a record of the wrong shape for the task,
one without target tokens, never a silent zero), the first few named in `skipped_examples`.
Only a set with nothing to score is an error, when its data is loaded: at the phase's start.
The loop evaluates the sets due at a step with `run_evals`; jobs and the CLI evaluate a saved
checkpoint with `evaluate_checkpoint`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from contracts.bounds import MAX_SKIPPED_EXAMPLE, MAX_SKIPPED_EXAMPLES
from contracts.jobs import EvaluateRequest
from contracts.reports import SKIP_REASONS, EvalResult
from contracts.workflow import EvalSpec, Phase, Workflow, perplexity
from worker.data.batch import IGNORE_INDEX, StoredRecord, record_row, stack_rows, window_row
from worker.data.inspect import wrong_kind_reason
from worker.data.store import KINDS, Stores, TokenFile
from worker.data.tokenizer import load_tokenizer, special_token_ids
from worker.error import ConfigError, DataError
from worker.link.reporter import Reporter
from worker.train.objective import objective_loss

_NO_TARGET = "with no target tokens: nothing of it can be scored"


@dataclass(frozen=True)
class EvalData:
    name: str  # the eval set's (EvalSpec.name)
    task: str
    path: str
    sequence_length: int
    rows: list[tuple[np.ndarray, np.ndarray]]  # (input_ids, labels), each at its own length
    records: int  # scored
    oversized_records: int
    pad_id: int
    skipped_records: dict[str, int] = field(default_factory=dict)  # by reason, oversized apart
    skipped_examples: list[str] = field(default_factory=list)  # "file:line: reason"


def load_eval_data(
    tokenizer: Tokenizer,
    spec: EvalSpec,
    *,
    sequence_length: int,
    stores: Stores | None = None,
) -> EvalData:
    """The rows of an eval file, read from its token store (without `stores`, a private
    one). Held-out text is cut into windows whose targets cover every token after the first
    exactly once; supervised records are fitted as in training. What cannot be scored is
    skipped and counted (lines that are not records, records of the wrong shape for the task,
    without target tokens, too long); DataError, naming the file, when nothing is left."""
    if stores is None:
        with Stores.temporary(tokenizer) as temporary:
            return load_eval_data(
                tokenizer, spec, sequence_length=sequence_length, stores=temporary
            )
    _, pad_id = special_token_ids(tokenizer)
    text = spec.task == "continued_pretrain"
    store = stores.get(spec.data, fit=None if text else sequence_length)
    skipped = _Skipped(spec.data, store)
    columns = store.records
    wrong = store.is_text() != text
    skipped.add(
        "wrong_shape", wrong, lambda i: wrong_kind_reason(KINDS[columns["kind"][i]], spec.task)
    )
    if text:
        scored = ~wrong
        # The windows of the text records only: a record of another shape is not held-out text.
        tokens = store.ids if scored.all() else store.ids[np.repeat(scored, store.lengths())]
        rows = [
            window_row(window, len(window) - 1, pad_id)
            for window in (
                tokens[start : start + sequence_length + 1]
                for start in range(0, max(len(tokens) - 1, 0), sequence_length)
            )
        ]
        oversized = np.zeros(len(store), bool)
    else:
        zero = ~wrong & columns["zero_target"]
        skipped.add("no_target", zero, lambda i: f"{KINDS[columns['kind'][i]]} record {_NO_TARGET}")
        oversized = ~wrong & ~zero & ~columns["fits"]
        skipped.add("oversized", oversized, lambda i: store.unusable_reason(i, sequence_length + 1))
        scored = ~wrong & ~zero & columns["fits"]
        rows = []
        for i in np.flatnonzero(scored).tolist():
            ids, mask = store.record(i)
            rows.append(record_row(StoredRecord(ids, mask), len(ids) - 1, pad_id))
    data = EvalData(
        name=spec.name,
        task=spec.task,
        path=spec.data,
        sequence_length=sequence_length,
        rows=rows,
        records=int(scored.sum()),
        oversized_records=int(oversized.sum()),
        pad_id=pad_id,
        skipped_records=skipped.counts(),
        skipped_examples=skipped.examples(),
    )
    if not rows:
        raise DataError(
            f"{spec.data}: nothing to evaluate in eval set {spec.name!r} (task {spec.task}, "
            f"sequence_length {sequence_length}): {_left_out(data)}"
        )
    return data


class _Skipped:
    """The records of an eval file that cannot be scored: the store's invalid lines, then each
    reason's records as `add` names them; counted by reason, and the first few kept."""

    def __init__(self, path: str, store: TokenFile) -> None:
        self.path = path
        self._counts = dict(store.invalid)
        # Per reason, its first MAX_SKIPPED_EXAMPLES records as (line, "file:line: reason").
        self._first: dict[str, list[tuple[int, str]]] = {}
        for invalid in store.invalid_lines:
            first = self._first.setdefault(invalid.reason, [])
            if len(first) < MAX_SKIPPED_EXAMPLES:
                first.append((invalid.line, invalid.message(path)))
        self._lines = store.records["line"]

    def add(self, reason: str, skipped: np.ndarray, why: Callable[[int], str]) -> None:
        """The records `skipped` (bool per record) for `reason`, each explained by `why(i)`."""
        indices = np.flatnonzero(skipped)
        if not indices.size:
            return
        self._counts[reason] = self._counts.get(reason, 0) + int(indices.size)
        first = self._first.setdefault(reason, [])
        for i in indices[: MAX_SKIPPED_EXAMPLES - len(first)].tolist():
            line = int(self._lines[i])
            first.append((line, f"{self.path}:{line}: {why(i)}"))

    def counts(self) -> dict[str, int]:
        """Skipped records by reason (SKIP_REASONS), those too long apart."""
        return {reason: n for reason, n in self._counts.items() if reason in SKIP_REASONS}

    def examples(self) -> list[str]:
        """The first MAX_SKIPPED_EXAMPLES by line, each reason's first among them before any
        reason's second, so a file with many records too long still shows its one bad line."""
        firsts = sorted(examples[0] for examples in self._first.values() if examples)
        rest = sorted(e for examples in self._first.values() for e in examples[1:])
        chosen = firsts[:MAX_SKIPPED_EXAMPLES]
        chosen += rest[: MAX_SKIPPED_EXAMPLES - len(chosen)]
        return [_cut(message) for _, message in sorted(chosen)]


def _cut(message: str) -> str:
    return (
        message if len(message) <= MAX_SKIPPED_EXAMPLE else message[: MAX_SKIPPED_EXAMPLE - 1] + "…"
    )


def _left_out(data: EvalData) -> str:
    """What an eval set skipped, in words: "3 too long, 1 malformed JSON; first: FILE:LINE..."."""
    counts = [f"{data.oversized_records} too long"] if data.oversized_records else []
    counts += [f"{n} {SKIP_REASONS[reason]}" for reason, n in data.skipped_records.items()]
    if not counts:
        return "it holds no records"
    return f"{', '.join(counts)}; first: {data.skipped_examples[0]}"


def evaluate_task(
    model: PreTrainedModel,
    data: EvalData,
    *,
    batch_size: int,
    step: int,
    phase: str,
) -> EvalResult:
    """Cross-entropy = total target NLL / total target tokens over the whole file (not a mean
    of batch means), computed by the training objective without gradients. Rows are padded to
    the longest of their batch; padding is never a target, so the batch size changes nothing."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64, device=device)
    total_tokens = 0
    try:
        with torch.no_grad():
            for start in range(0, len(data.rows), batch_size):
                chunk = data.rows[start : start + batch_size]
                length = max(len(inputs) for inputs, _ in chunk)
                batch = stack_rows([_pad(row, length, data.pad_id) for row in chunk])
                nll, tokens = objective_loss(model, batch.to(device))
                total_nll += nll.double()
                total_tokens += tokens
    finally:
        model.train(was_training)
    cross_entropy = total_nll.item() / total_tokens  # CPU-GPU sync, once per task
    return EvalResult(
        name=data.name,
        task=data.task,
        step=step,
        phase=phase,
        cross_entropy=cross_entropy,
        perplexity=perplexity(cross_entropy),
        records=data.records,
        target_tokens=total_tokens,
        oversized_records=data.oversized_records,
        skipped_records=data.skipped_records,
        skipped_examples=data.skipped_examples,
    )


def run_evals(
    model: PreTrainedModel,
    workflow: Workflow,
    eval_data: list[EvalData],
    reporter: Reporter,
    *,
    step: int,
    due: list[int],
    phase: Phase,
) -> list[EvalResult]:
    """The results of the eval tasks `due` (indices into `workflow.evals` and `eval_data`) on
    the model after `step`, in the order of `due`."""
    results = []
    for i in due:
        results.append(
            evaluate_task(
                model,
                eval_data[i],
                batch_size=workflow.evals[i].batch_size,
                step=step,
                phase=phase.name,
            )
        )
        reporter.progress()  # an eval reports nothing until it ends: each set done is progress
    return results


def _pad(
    row: tuple[np.ndarray, np.ndarray], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    inputs, labels = row
    extra = length - len(inputs)
    return (
        np.pad(inputs, (0, extra), constant_values=pad_id),
        np.pad(labels, (0, extra), constant_values=IGNORE_INDEX),
    )


def evaluate_checkpoint(
    request: EvaluateRequest,
    *,
    device: torch.device | None = None,
    store_root: Path | None = None,
) -> EvalResult:
    """Evaluate a `save_pretrained` directory (a run's checkpoint, or any local model) outside
    a run. Its step and phase come from a trainctl checkpoint's state.json when there is one
    (0 and "" otherwise). The eval file is read through the token stores under `store_root`
    (a private store without it)."""
    loaded = _load_checkpoint(request, device=device)
    return _evaluate_request(loaded, request, store_root)


def evaluate_checkpoint_sets(
    requests: list[EvaluateRequest],
    *,
    device: torch.device | None = None,
    store_root: Path | None = None,
) -> list[EvalResult]:
    """`evaluate_checkpoint` for several eval sets of one checkpoint and tokenizer (a
    workflow's, each at its own geometry), loading the model once. An error names the set."""
    if not requests:
        return []
    first = requests[0]
    for request in requests:
        if (request.checkpoint, request.tokenizer) != (first.checkpoint, first.tokenizer):
            raise ConfigError("every eval set must name the same checkpoint and tokenizer")
    loaded = _load_checkpoint(first, device=device)
    results = []
    for request in requests:
        try:
            results.append(_evaluate_request(loaded, request, store_root))
        except DataError as err:
            raise DataError(f"eval set {request.name or request.task!r}: {err}") from err
    return results


@dataclass(frozen=True)
class _Loaded:
    model: PreTrainedModel
    tokenizer: Tokenizer
    step: int
    phase: str


def _load_checkpoint(request: EvaluateRequest, *, device: torch.device | None) -> _Loaded:
    from transformers import AutoModelForCausalLM

    directory = Path(request.checkpoint)
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"checkpoint {directory}: no config.json; expected a save_pretrained directory"
        )
    tokenizer = load_tokenizer(request.tokenizer or directory)
    try:
        # Safetensors only: pickled weights (pytorch_model.bin) are never loaded.
        model = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, use_safetensors=True
        )
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint {directory} cannot be loaded: {err}") from err
    model = model.to(device or torch.device("cpu"))  # type: ignore[arg-type]
    step, phase = 0, ""
    state = directory / "state.json"
    if state.is_file():
        try:
            saved = json.loads(state.read_text())
            step, phase = int(saved.get("step", 0)), str(saved.get("phase_name", ""))
        except (ValueError, AttributeError) as err:  # not JSON, not an object, not a number
            raise ConfigError(f"checkpoint {state} is not a trainctl state file: {err}") from err
    return _Loaded(model, tokenizer, step, phase)


def _evaluate_request(
    loaded: _Loaded, request: EvaluateRequest, store_root: Path | None
) -> EvalResult:
    spec = EvalSpec(name=request.name or request.task, task=request.task, data=request.data)
    stores = None if store_root is None else Stores(store_root, loaded.tokenizer)
    data = load_eval_data(
        loaded.tokenizer, spec, sequence_length=request.sequence_length, stores=stores
    )
    return evaluate_task(
        loaded.model,
        data,
        batch_size=request.batch_size,
        step=loaded.step,
        phase=loaded.phase,
    )
