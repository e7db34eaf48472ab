"""Identity values typed as the upstream reads them: `int` and `float` sources and path parameters.

An upstream that reads `item` as a number serves `042`, `42` and `0042` as one item; counted as sent
they would be three keys, and a stock of 3 would sell 9. A typed source keys every spelling of one
number as that number. Spellings that readers disagree on (`+42`, `4_2` and `٤٢` are 42 to Python's
int() and pydantic, 4 or NaN to JavaScript's parseInt; `4e1`, `0x2a`, `42.0` likewise) are a 400: the
gateway cannot know which number the upstream will act on, so it neither counts nor forwards them.
"""

from __future__ import annotations

import re

TYPES = ("int", "float")
_INT = re.compile(r"[0-9]{1,64}\Z")
_FLOAT = re.compile(r"([0-9]{1,64})(?:\.([0-9]{1,64}))?\Z")


def canonical(type_: str, text: str) -> str:
    """`text` as the number it spells, in one spelling; ValueError saying what it must be for any other."""
    if type_ == "int":
        if _INT.match(text) is None:
            raise ValueError(f"must be written in plain decimal digits (0-9), not {text[:40]!r}")
        return str(int(text))
    found = _FLOAT.match(text)
    if found is None:
        raise ValueError(f"must be a decimal number written with 0-9 and one '.', not {text[:40]!r}")
    whole, fraction = found.group(1).lstrip("0") or "0", (found.group(2) or "").rstrip("0")
    return f"{whole}.{fraction}" if fraction else whole


def canonical_bytes(type_: str, value: bytes) -> bytes:
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        text = value.decode("utf-8", "replace")  # refused below: only ASCII digits pass
    return canonical(type_, text).encode()
