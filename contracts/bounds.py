"""The sizes of the columns that what clients and workers send is stored in.

Request models bound their fields with these (`Field(max_length=..., le=...)`) and the tables
(service/models.py) are declared with them, so a value that passes validation fits its column
on every database. SQLite stores an over-long string, a 33-bit integer or a NUL character
without a word; Postgres refuses all three, and the API must answer that with 422 naming the
field, never 500.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

# Integer columns are 32-bit: steps, counts, pids, budgets, phase indices.
MAX_COUNT = 2**31 - 1
# String(200): run, workflow, phase and metric names, Idempotency-Key.
MAX_NAME = 200
# String(255): worker hostnames (a DNS name is at most 253 characters).
MAX_HOSTNAME = 255
# String(64): one tag of a run.
MAX_TAG = 64
# String(64): the task an evaluation is stored under.
MAX_TASK = 64
# String(1024): a file path stored as text (the file an attempt is preparing).
MAX_PATH = 1024
# String(32): run, attempt, job and token ids.
MAX_ID = 32
# String(64): SHA-256 hex digests (workflow ids, signatures).
SHA256_HEX = 64
# An eval result's examples of the records it skipped (`file:line: reason`): at most this
# many, each at most this long (a path and a sentence; the worker cuts a longer one), and at
# most this many reasons, each a short key (contracts.reports.SKIP_REASONS).
MAX_SKIPPED_EXAMPLES = 5
MAX_SKIPPED_EXAMPLE = 2000
MAX_SKIP_REASONS = 16
MAX_SKIP_REASON = 64
# A run's budgets (max_restarts, max_preemptions): far below MAX_COUNT, as attempt numbers count
# every restart and preemption.
MAX_BUDGET = 10_000


def refuse_nul(value: str) -> str:
    """A string a text column can hold: Postgres refuses NUL (U+0000) in text, SQLite keeps it.
    JSON columns need no such check: NUL travels in them escaped (\\u0000)."""
    if "\0" in value:
        raise PydanticCustomError(
            "nul_character",
            "contains a NUL character (U+0000) at position {position}, which cannot be stored",
            {"position": value.index("\0")},
        )
    return value


class _NoNul:
    """Refuses NUL (`refuse_nul`), and says so in the JSON Schema (a `pattern` without U+0000),
    so that a request the document allows is one the server takes."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(refuse_nul, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler(schema)
        out.setdefault("pattern", "^[^\\u0000]*$")
        return out


# Annotated[str, Field(max_length=...), NO_NUL]: a string stored in a String or Text column.
NO_NUL = _NoNul()


def replace_nul(value: str) -> str:
    return value.replace("\0", "\ufffd")


# Annotated[str, NUL_REPLACED]: a message for people (an exception's text, say), stored in a
# Text column. A NUL in it becomes U+FFFD instead of failing the report that carries it.
NUL_REPLACED = AfterValidator(replace_nul)


EMPTY_PATH = "is empty; give the path of a file or folder, absolute or relative to the data root"


def refuse_empty_path(value: str) -> str:
    if not value:
        raise PydanticCustomError("empty_path", EMPTY_PATH)
    return value


# A file or folder a request names. The schema says `minLength: 1` (so a generated request is
# never one the server refuses); an empty one is refused naming its field, with a message of
# its own (pydantic's "at least 1 character" says nothing of paths).
UserPath = Annotated[
    str, Field(json_schema_extra={"minLength": 1}), AfterValidator(refuse_empty_path)
]
