"""The model and the device it runs on (its tokenizer: worker.data.tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from contracts.workflow import Workflow
from worker.error import ConfigError
from worker.model.rng import PrivateRandom

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


# --- device ---------------------------------------------------------------------------------


def select_device(preference: str) -> torch.device:
    """cuda when available and allowed ("auto" or "cuda"), else cpu. Asking for cuda on a
    machine without it is a configuration error, not a silent fall back to a 100x slower CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested (TRAINCTL_DEVICE) but CUDA is not available")
    if preference in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def configure_determinism(device: torch.device) -> None:
    """On CPU, training is float32 and bit-reproducible (a resumed run equals an uninterrupted
    one); on CUDA it runs under bf16 autocast (see `worker.train.objective`) and is not."""
    torch.use_deterministic_algorithms(device.type == "cpu")


# --- model ----------------------------------------------------------------------------------


def build_model(workflow: Workflow, device: torch.device) -> PreTrainedModel:
    """The causal LM of `workflow.model`, in float32 and train mode on `device`. A config is
    initialised from a private generator seeded by `workflow.seed` alone, so two processes
    build identical weights whatever else they draw."""
    with PrivateRandom(workflow.seed, torch.device("cpu")).drawing():
        model = _instantiate(workflow)
    # transformers declares `to` through functools.wraps(nn.Module.to), which mypy misreads.
    model.to(device)  # type: ignore[arg-type]
    return model.train()


def _instantiate(workflow: Workflow) -> PreTrainedModel:
    spec = workflow.model
    model: PreTrainedModel
    if spec.pretrained is not None:
        try:
            # Safetensors only: pickled weights (pytorch_model.bin) are never loaded.
            model = AutoModelForCausalLM.from_pretrained(
                spec.pretrained, dtype=torch.float32, use_safetensors=True, local_files_only=True
            )
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.pretrained: cannot load {spec.pretrained}: {err}") from err
    else:
        config: dict[str, Any] = dict(spec.config or {})
        model_type = config.pop("model_type", "llama")
        try:
            model_config = AutoConfig.for_model(model_type, **config)
        # Config classes raise ValueError, TypeError, or huggingface_hub's validation errors
        # (plain Exceptions); every one of them means the config as written is unusable.
        except Exception as err:
            raise ConfigError(f"model.config (model_type {model_type!r}): {err}") from err
        try:
            model = AutoModelForCausalLM.from_config(model_config)
        except ValueError as err:
            raise ConfigError(f"model.config (model_type {model_type!r}): {err}") from err
    return model


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load safetensors weights into `model`: a .safetensors file, or a directory holding
    model.safetensors (or a sharded model.safetensors.index.json), i.e. `save_pretrained`
    output. Every parameter the model trains must be in the file; tied weights are stored once.
    """
    path = Path(path)
    tensors = _read_safetensors(path)
    required = {name for name, _ in model.named_parameters()}  # dedups tied weights
    required |= {name for name, _ in model.named_buffers() if name in model.state_dict()}
    known = set(model.state_dict())
    missing, unexpected = sorted(required - set(tensors)), sorted(set(tensors) - known)
    if missing or unexpected:
        raise ConfigError(
            f"weights {path} do not fit the model: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [
        f"{name} {tuple(t.shape)} vs model {shapes[name]}"
        for name, t in tensors.items()
        if tuple(t.shape) != shapes[name]
    ]
    if wrong:
        raise ConfigError(f"weights {path} do not fit the model: shapes differ: {wrong[:5]}")
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file or a save_pretrained directory; ConfigError naming the
    file when it is not safetensors (a pickle, a truncated or corrupt file: nothing is ever
    unpickled) or a shard index names a file outside the directory."""
    if path.is_file():
        return _load_file(path)
    if (path / WEIGHTS_FILE).is_file():
        return _load_file(path / WEIGHTS_FILE)
    if (path / WEIGHTS_INDEX_FILE).is_file():
        index_path = path / WEIGHTS_INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"weights index {index_path} is unusable: {err!r}") from err
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".."):
                raise ConfigError(
                    f"weights index {index_path} names shard {str(shard)[:200]!r}, which is not "
                    "a file name in its directory"
                )
            tensors.update(_load_file(path / shard))
        return tensors
    raise ConfigError(f"no safetensors weights at {path} (expected a file or {WEIGHTS_FILE})")


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ConfigError(
            f"weights {path} are not a readable safetensors file ({err}); trainctl loads "
            "safetensors only and never unpickles weights"
        ) from err
