"""Hostile workflow documents for hypothesis: a valid document with one to three mutations
(a value replaced by one of another type, out of range, huge or full of odd unicode; a field
removed; a key added), or no object at all.

Shared by tests/unit/contracts/test_workflow_fuzz.py (the contract) and
tests/integration/test_fuzz_api.py (the live API).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

Location = tuple[int | str, ...]

# Strings a careless parser, database or terminal trips on: NUL, lone surrogates (JSON carries
# them escaped, UTF-8 cannot), right-to-left overrides, joined emoji, a byte-order mark, path
# escapes (a home directory that does not exist too), quoting and template syntax, and a string
# far longer than any column.
ODD_STRINGS = [
    "",
    " ",
    "\0",
    "a\0b",
    "\ud800",
    "x\udfffy",
    "\u202eevil\u202c",
    "\u05e9\u05dc\u05d5\u05dd",
    "👩\u200d👩\u200d👧",
    "\ufeff",
    "../../../../etc/passwd",
    "/etc/passwd",
    "~no-such-user-fuzz/x",
    "%00",
    "\r\n\t",
    "' OR 1=1 --",
    "${jndi:ldap://x}",
    "\\",
    "x" * 100_000,
]
# Numbers past every bound: 32- and 64-bit edges, far past them, and the floats JSON has no
# word for (Python's parser accepts NaN and Infinity).
ODD_NUMBERS: list[int | float] = [
    -1,
    0,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**400,
    1e308,
    -0.0,
    0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
]

# Every character, with lone surrogates (a tiny share of all code points) drawn often.
ANY_CHAR = st.one_of(st.characters(exclude_categories=()), st.characters(categories=["Cs"]))
scalars = st.one_of(
    st.sampled_from(ODD_STRINGS),
    st.sampled_from(ODD_NUMBERS),
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(ANY_CHAR, max_size=40),
)
hostile_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(ANY_CHAR, max_size=10), inner)
    ),
    max_leaves=8,
)


def locations(doc: Any, here: Location = ()) -> Iterator[Location]:
    """Every value inside `doc` (not `doc` itself), by its keys and indices."""
    if isinstance(doc, dict):
        items: Iterator[tuple[int | str, Any]] = iter(doc.items())
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return
    for key, value in items:
        yield (*here, key)
        yield from locations(value, (*here, key))


def _at(doc: Any, location: Location) -> Any:
    for key in location:
        doc = doc[key]
    return doc


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """`base` with one to three mutations."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([(), *locations(doc)]))
        kind = draw(st.sampled_from(["replace", "delete", "add"]))
        target = _at(doc, where)
        if kind == "add" and isinstance(target, dict):
            target[draw(st.text(ANY_CHAR, max_size=12))] = draw(hostile_values)
        elif kind == "add" and isinstance(target, list):
            target.append(draw(hostile_values))
        elif where and kind == "delete":
            parent = _at(doc, where[:-1])
            del parent[where[-1]]
        elif where:
            _at(doc, where[:-1])[where[-1]] = draw(hostile_values)
    return doc


def hostile_workflows(base: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly `base` mutated; now and then no object at all, or an empty one."""
    return st.one_of(
        mutated(base),
        mutated(base),
        mutated(base),
        st.sampled_from([None, [], {}, "workflow", 1, [base]]),
    )
