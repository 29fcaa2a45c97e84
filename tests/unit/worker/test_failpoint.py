from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from worker import failpoint
from worker.checkpoint import list_checkpoints, remove_stale_temporaries
from worker.settings import WorkerSettings

_MODEL = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
}


def test_a_spec_parses_into_armed_points() -> None:
    assert failpoint.parse("mid_checkpoint@10, after_step@3,") == {
        ("mid_checkpoint", 10),
        ("after_step", 3),
    }
    assert failpoint.parse("") == frozenset()
    for bad in ("mid_checkpoint", "mid-checkpoint@3", "after_step@x", "after_step@-1"):
        with pytest.raises(ValueError, match="failpoint"):
            failpoint.parse(bad)


def test_settings_read_and_check_the_failpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINCTL_FAILPOINTS", "before_step@2")
    assert WorkerSettings().failpoints == "before_step@2"
    monkeypatch.setenv("TRAINCTL_FAILPOINTS", "before_stpe@2")
    with pytest.raises(ValueError, match="before_stpe@2"):
        WorkerSettings()


def test_an_unarmed_point_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(failpoint, "_armed", None)
    failpoint.arm("after_step@3")
    failpoint.hit("after_step", 2)
    failpoint.hit("before_step", 3)
    assert kills == []
    failpoint.hit("after_step", 3)  # the armed one reaches os.kill (patched here)
    assert kills == [(os.getpid(), signal.SIGKILL)]


_SAVE_SCRIPT = """
import sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
from contracts.workflow import OptimizerSpec
from worker.checkpoint import CheckpointState, CheckpointWriter
from worker.model import load_tokenizer
from worker.optim import build_optimizers

config = dict(__CONFIG__)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
optimizers = build_optimizers(model, OptimizerSpec())
state = CheckpointState(step=5, phase_index=0, phase_name="pt", phase_step=5, tokens_seen=0,
                        signature="sig", attempt_id="a", groups=optimizers.group_names())
# The trainer's path: the write runs in the background thread, whose SIGKILL kills us all.
writer = CheckpointWriter(directory=Path(sys.argv[1]), tokenizer=load_tokenizer(sys.argv[2]))
writer.start(model=model, optimizers=optimizers, state=state)
print("started", flush=True)
writer.wait()
print("saved")
"""


def test_sigkill_mid_checkpoint_leaves_only_a_temporary_that_is_cleaned_up(
    tmp_path: Path, tokenizer_path: Path
) -> None:
    directory = tmp_path / "checkpoints"
    script = _SAVE_SCRIPT.replace("__CONFIG__", json.dumps(_MODEL))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRAINCTL_FAILPOINTS": "mid_checkpoint@5", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(directory), str(tokenizer_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout == "started\n"
    (tmp,) = directory.iterdir()
    assert tmp.name.startswith(".tmp-step-00000005")
    assert (tmp / "model.safetensors").is_file() and not (tmp / "manifest.json").exists()
    assert list_checkpoints(directory) == []

    remove_stale_temporaries(directory)
    assert list(directory.iterdir()) == []


def test_the_rng_restore_switch_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings().restore_rng is True
    monkeypatch.setenv("TRAINCTL_RESTORE_RNG", "false")
    assert WorkerSettings().restore_rng is False
