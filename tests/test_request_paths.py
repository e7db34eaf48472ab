"""Path normalization (gateway.http.request.normalize_path) as a property: whatever a client sends,
what the routes match and the upstream receives is one canonical path, or a 400."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.http.request import normalize_path

# the pieces paths that could be read two ways are made of, and plain ones
PIECES = [b"/", b"//", b"/.", b"/..", b"./", b"a", b"B", b"~", b"-", b"_", b"%41", b"%2f", b"%2F", b"%5c", b"%00",
          b"%3b", b"%7e", b"%zz", b"%", b"%2", b";", b"\\", b"..;", b"%2e", b"%2E%2e", b"\xc3\xa9", b"%0a", b"%0D",
          b"%09", b"%7F", b"%1f", b"%20", b"%7f"]
CONTROL = re.compile(rb"%(?:[01][0-9A-Fa-f]|7[Ff])")
paths = st.lists(st.sampled_from(PIECES), max_size=12).map(lambda parts: b"".join(parts))


@given(paths)
def test_a_path_is_canonical_once_normalized_or_refused(raw: bytes) -> None:
    try:
        path = normalize_path(raw)
    except BadRequest:
        return
    assert path.startswith(b"/")
    assert b"//" not in path and b";" not in path and b"\\" not in path
    segments = path.split(b"/")[1:]
    assert b"." not in segments and b".." not in segments
    assert not CONTROL.search(path)  # no CR, LF, NUL, ... once decoded
    assert normalize_path(path) == path  # canonical: a second pass changes nothing


@given(st.lists(st.sampled_from([b"a", b"B", b"~", b"-", b"_", b"0", b".x", b"x."]), min_size=1, max_size=6))
def test_a_path_with_nothing_to_normalize_is_kept_byte_for_byte(segments: list[bytes]) -> None:
    raw = b"/" + b"/".join(segments)
    assert normalize_path(raw) == raw


@pytest.mark.parametrize("raw", [b"a/b", b"", b"/a;b", b"/a\\b", b"/%2f", b"/%zz", b"/..", b"/a/../..", b"/a%0Ab",
                                 b"/a%0d%0a", b"/%00", b"/%09", b"/%7f", b"/x/%1F"])
def test_what_could_be_read_two_ways_is_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        normalize_path(raw)
