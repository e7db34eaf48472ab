"""X-Request-Id: the client's when usable, else one made here, unique without a system call."""

from __future__ import annotations

import itertools
import os

REQUEST_ID_MAX = 128

_PREFIX = os.urandom(10).hex().encode()  # per process; with the counter, unique
_COUNTER = itertools.count()


def new_request_id() -> bytes:
    return b"%s%012x" % (_PREFIX, next(_COUNTER))


def usable_request_id(sent: bytes | None) -> bytes | None:
    """The client's X-Request-Id if it is 1 to REQUEST_ID_MAX visible ASCII characters."""
    if sent is not None and 0 < len(sent) <= REQUEST_ID_MAX and all(33 <= c < 127 for c in sent):
        return sent
    return None


def request_id_for(sent: bytes | None) -> bytes:
    return usable_request_id(sent) or new_request_id()
