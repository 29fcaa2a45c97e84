"""The tokenizer: a `tokenizers` tokenizer.json that knows the two special tokens trainctl
needs."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from worker.error import ConfigError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizers` tokenizer from a tokenizer.json, or a directory holding one. It must know
    EOS_TOKEN (joins documents, ends targets) and PAD_TOKEN (fills short rows)."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"tokenizer: {file} not found")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"tokenizer: {file} cannot be loaded: {err}") from err
    missing = [t for t in (EOS_TOKEN, PAD_TOKEN) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ConfigError(
            f"tokenizer {file} lacks the special token(s) {', '.join(missing)}; "
            f"trainctl needs {EOS_TOKEN} (end of document) and {PAD_TOKEN} (padding): "
            "add them as special tokens and retrain or extend the tokenizer"
        )
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos_id, pad_id)."""
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    assert eos is not None and pad is not None, "load_tokenizer checks both"
    return eos, pad
