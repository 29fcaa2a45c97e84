"""Training failures, each carrying the failure cause the service records for it.

The cause decides what the service does next: data, config, nan, oom, checkpoint, disk_full
and signature_mismatch are never retried blindly; infrastructure failures are.
"""

from __future__ import annotations

import traceback

import torch

from contracts.reports import FailureCause
from worker.files import out_of_space


class TrainingError(Exception):
    """A failure of this attempt that the worker reports with `cause` and its message."""

    cause: FailureCause = "infrastructure"


class DataError(TrainingError):
    """A data file cannot be read or encoded (bad JSON, a missing field, an over-long record)."""

    cause: FailureCause = "data"


class ConfigError(TrainingError):
    """The workflow cannot be trained as written (bad model config, unusable tokenizer)."""

    cause: FailureCause = "config"


class NonFiniteLoss(TrainingError):
    cause: FailureCause = "nan"


class SignatureMismatch(TrainingError):
    """An input's content differs from the one the run's signature was computed over."""

    cause: FailureCause = "signature_mismatch"


class CheckpointError(TrainingError):
    """A checkpoint is incomplete, corrupt or does not belong to this run, and no older one
    can stand in for it. Deterministic: another attempt would read the same bytes, so the
    cause is `checkpoint`, which the service never retries blindly."""

    cause: FailureCause = "checkpoint"


class DiskFull(TrainingError):
    """A write ran out of space (ENOSPC, EDQUOT, or torch's zip writer failing on a disk with
    no room left). Another attempt would meet the same full disk and spend a restart on it:
    cause `disk_full`, which fails the run at once; it is resumed once space is freed."""

    cause: FailureCause = "disk_full"


class OptimizerCoverageError(CheckpointError):
    """After a resume, an optimizer holds parameters that got no gradient or did not change: it
    was built over tensors the model no longer uses (e.g. before the weights were loaded with
    `assign=True`). Deterministic, a bug of the restore order: cause `config`, so the service
    does not retry it blindly."""

    cause: FailureCause = "config"


def origin(err: BaseException) -> str:
    """Where `err` was raised: `file:line in function`, for failure messages."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "unknown location"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def failure_cause(err: BaseException) -> FailureCause:
    """The cause an attempt that ended with `err` is reported with: a TrainingError's own;
    out of memory (the device's or the host's) `oom`; a write that met a full disk
    `disk_full`; anything else `infrastructure`, which the service retries."""
    if isinstance(err, TrainingError):
        return err.cause
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return "oom"
    if out_of_space(err) is not None:
        return "disk_full"
    return "infrastructure"
