"""A checkpoint that does not fit on its disk: refused before anything is written when the free
space says so, and when a write runs out of space all the same, no partial directory is left
and the error names the directory, the space free and roughly what the checkpoint needed, with
the cause `disk_full` (which the service never retries blindly)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from test_checkpoint import save, state_at, trained
from tokenizers import Tokenizer

from contracts.workflow import Workflow
from worker.checkpoint.layout import OPTIMIZER
from worker.checkpoint.writer import CheckpointWriter
from worker.error import DiskFull
from worker.model.rng import PrivateRandom

# What torch.save raised when the artifact store filled under it: its zip writer hides the errno.
ZIP_WRITER_FAILURE = "[enforce fail at inline_container.cc:672] . unexpected pos 398976 vs 398864"


@pytest.fixture
def workflow(
    make_workflow: Callable[..., Workflow], make_text_file: Callable[..., Path]
) -> Workflow:
    return make_workflow(
        [{"name": "pt", "objective": "continued_pretrain", "data": [make_text_file()], "steps": 9}]
    )


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def reporting_free(monkeypatch: pytest.MonkeyPatch, *frees: int) -> list[Path]:
    """shutil.disk_usage answering `frees` in turn, the last one from then on; returns the
    paths it was asked about."""
    asked: list[Path] = []

    def usage(path: str | os.PathLike[str]) -> Usage:
        asked.append(Path(path))
        free = frees[min(len(asked), len(frees)) - 1]
        return Usage(total=2**40, used=2**40 - free, free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return asked


def failing_save(error: Callable[[Path], Exception]) -> Callable[..., None]:
    """torch.save that gets part of the file onto the disk, then fails with `error(file)`."""

    def save(obj: Any, f: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        Path(f).write_bytes(b"\0" * 4096)
        raise error(Path(f))

    return save


def needs_mib(message: str) -> float:
    found = re.search(r"needs about ([\d.]+) MiB", message)
    assert found is not None, message
    return float(found.group(1))


def write_in_background(directory: Path, workflow: Workflow, tokenizer: Tokenizer) -> None:
    """Save step 3 as the trainer does: snapshot, then the writer thread; its error raises
    here, in the caller's thread."""
    model, optimizers = trained(workflow)
    writer = CheckpointWriter(directory=directory, tokenizer=tokenizer)
    try:
        writer.start(
            model=model,
            optimizers=optimizers,
            state=state_at(3, optimizers),
            rng=PrivateRandom(0, torch.device("cpu")).state_dict(),
        )
        writer.wait()
    finally:
        writer.close()


def test_a_save_without_room_on_its_disk_is_refused_before_anything_is_written(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizers = trained(workflow)
    written = save(tmp_path / "measured", 3, model, tokenizer, optimizers)
    size = sum(p.stat().st_size for p in written.rglob("*") if p.is_file())

    asked = reporting_free(monkeypatch, 2**20)
    directory = tmp_path / "checkpoints"
    with pytest.raises(DiskFull) as raised:
        save(directory, 3, model, tokenizer, optimizers)

    message = str(raised.value)
    assert raised.value.cause == "disk_full"
    assert f"{directory}: 1.0 MiB free" in message
    # Roughly what it needed: at least what the same checkpoint took where it fitted.
    assert needs_mib(message) * 2**20 >= size
    assert "resume" in message  # what to do
    assert asked == [directory]
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_that_runs_out_of_space_leaves_no_partial_checkpoint_and_says_so(
    tmp_path: Path,
    workflow: Workflow,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
) -> None:
    directory = tmp_path / "checkpoints"
    reporting_free(monkeypatch, 2**30, 2**10)  # room before the save; 1 KiB once it failed
    monkeypatch.setattr(
        torch, "save", failing_save(lambda f: OSError(code, os.strerror(code), str(f)))
    )
    with pytest.raises(DiskFull) as raised:
        write_in_background(directory, workflow, tokenizer)

    message = str(raised.value)
    assert f"{directory}: 0.0 MiB free" in message
    assert needs_mib(message) > 0
    assert OPTIMIZER in message and os.strerror(code) in message  # the write that failed
    assert list(directory.iterdir()) == []  # the partial temporary directory is gone


def test_torch_s_zip_writer_error_on_a_full_disk_is_a_full_disk(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save's RuntimeError says nothing of space: the free space after it does."""
    directory = tmp_path / "checkpoints"
    reporting_free(monkeypatch, 2**30, 0)
    monkeypatch.setattr(torch, "save", failing_save(lambda f: RuntimeError(ZIP_WRITER_FAILURE)))
    with pytest.raises(DiskFull) as raised:
        write_in_background(directory, workflow, tokenizer)

    message = str(raised.value)
    assert f"{directory}: 0.0 MiB free" in message and ZIP_WRITER_FAILURE in message
    assert list(directory.iterdir()) == []


def test_the_same_error_with_room_to_spare_is_not_a_full_disk(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "checkpoints"
    reporting_free(monkeypatch, 2**30)
    monkeypatch.setattr(torch, "save", failing_save(lambda f: RuntimeError(ZIP_WRITER_FAILURE)))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        write_in_background(directory, workflow, tokenizer)
    assert list(directory.iterdir()) == []  # never put in place, so never left behind
