"""API keys and their plans at runtime (`keys:` in routes.yaml; the admin port's /keys).

A key is never stored: Redis holds its digest (BLAKE2b-64, personalised, 16 hex digits: its
fingerprint, `kf_...`, which logs and listings show) and its plan, in one hash under the `{~keys}`
tag, with a list of the last changes and a version counter beside it, so a worker reads only what
changed. Every write also bumps the deployment's change signal (gateway/overrides.py), which every
worker reads once a second: a change applies everywhere within about a second, with no Redis call
per request. A worker keeps every key as two parallel arrays, the digests sorted (8 bytes each) and
their plans (1 byte each): 9 bytes a key, a lookup is a binary search (docs/api-keys.md has the
numbers for 1M keys).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gateway.keys import FINGERPRINT, digest, fingerprint, from_fingerprint
from gateway.scripts import Script

if TYPE_CHECKING:
    from gateway.limiter import Limiter

__all__ = ["FINGERPRINT", "KeyStore", "KeyTable", "digest", "fingerprint", "from_fingerprint"]

WRITE = Script("keys_write")
CHANGED = Script("overrides_changes")  # the same list-and-version layout as a rule's overrides
CHANGES = 1000  # changes listed; a worker further behind reads the hash whole
PAGE = 10_000   # keys read per call when read whole
MAX_KEY_BYTES = 1024
MAX_BULK = 10_000  # keys in one POST /keys


class KeyTable:
    """Every registered key of the deployment, as digests sorted with their plans."""

    def __init__(self) -> None:
        self.digests = array("Q")
        self.plan_of = array("B")
        self.plans: list[str] = []            # plan index -> name
        self.index: dict[str, int] = {}       # name -> plan index
        self.version = 0
        self.loaded = False  # read from Redis at least once: until then no key is known to be unknown

    def __len__(self) -> int:
        return len(self.digests)

    def _plan_index(self, plan: str) -> int:
        at = self.index.get(plan)
        if at is None:
            at = self.index[plan] = len(self.plans)
            self.plans.append(plan)
        return at

    def plan(self, key: bytes) -> str | None:
        """The key's plan, or None when it is not registered."""
        value = digest(key)
        at = bisect.bisect_left(self.digests, value)
        if at < len(self.digests) and self.digests[at] == value:
            return self.plans[self.plan_of[at]]
        return None

    def load(self, pairs: Iterable[tuple[int, str]], version: int) -> None:
        """Replace every key: (digest, plan) pairs."""
        self.plans, self.index = [], {}
        self.load_packed([value << 8 | self._plan_index(plan) for value, plan in pairs], list(self.plans), version)

    def load_packed(self, packed: list[int], plans: list[str], version: int) -> None:
        """Replace every key: each `digest << 8 | plan index` (into `plans`), sorted here in place
        (one list of ints sorts several times faster than pairs)."""
        packed.sort()
        self.plans, self.index = list(plans), {plan: at for at, plan in enumerate(plans)}
        self.digests = array("Q", [value >> 8 for value in packed])
        self.plan_of = array("B", [value & 255 for value in packed])
        self.version = version
        self.loaded = True

    def apply(self, changes: Mapping[int, str | None], version: int) -> None:
        """Set (a plan) or remove (None) each digest."""
        for value, plan in changes.items():
            at = bisect.bisect_left(self.digests, value)
            present = at < len(self.digests) and self.digests[at] == value
            if plan is None:
                if present:
                    del self.digests[at]
                    del self.plan_of[at]
            elif present:
                self.plan_of[at] = self._plan_index(plan)
            else:
                self.digests.insert(at, value)
                self.plan_of.insert(at, self._plan_index(plan))
        self.version = version


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class KeyStore:
    """The keys in Redis, through the limiter's runner (scripts only)."""

    def __init__(self, limiter: Limiter, prefix: str) -> None:
        self.limiter = limiter
        self.prefix = prefix

    @property
    def _keys(self) -> list[str]:
        tag = f"{self.prefix}:{{~keys}}"
        return [f"{tag}:plans", f"{tag}:changes", f"{tag}:versions"]

    async def write(self, entries: Mapping[int, str | None]) -> tuple[int, int]:
        """Set or remove (None) each digest's plan in one call: the new version, and how many of
        the digests were registered before."""
        args: list[str | int] = [CHANGES]
        for value, plan in entries.items():
            args += [f"{value:016x}", plan or ""]
        reply = await self.limiter.run_script(WRITE, self._keys, args)
        return int(reply[0]), int(reply[1])

    async def plan(self, value: int) -> str | None:
        from gateway.overrides import COMMAND

        found = await self.limiter.run_script(COMMAND, [self._keys[0]], ["HGET", f"{value:016x}"])
        return None if found is None else _text(found)

    async def page(self, cursor: str, count: int) -> tuple[str, list[tuple[int, str]]]:
        from gateway.overrides import COMMAND

        reply = await self.limiter.run_script(COMMAND, [self._keys[0]], ["HSCAN", cursor, "COUNT", count])
        flat = reply[1]
        return _text(reply[0]), [(int(_text(flat[j]), 16), _text(flat[j + 1])) for j in range(0, len(flat), 2)]

    async def changes(self, since: int) -> tuple[int, dict[int, str | None] | None]:
        reply = await self.limiter.run_script(CHANGED, self._keys, ["keys", since])
        version, listed, flat = int(reply[0]), int(reply[1]), reply[2:]
        if not listed:
            return version, None
        return version, {int(_text(flat[j]), 16): None if flat[j + 1] is None else _text(flat[j + 1])
                         for j in range(0, len(flat), 2)}

    async def read_all(self) -> tuple[int, list[int], list[str]]:
        """The version (read first: a change meanwhile is read next time) and every key, packed as
        `KeyTable.load_packed` takes them."""
        from gateway.overrides import COMMAND

        version, _ = await self.changes(-1)  # -1: never listed, so only the version comes back
        packed: list[int] = []
        plans: dict[bytes, int] = {}
        cursor = b"0"
        while True:
            reply = await self.limiter.run_script(COMMAND, [self._keys[0]], ["HSCAN", cursor, "COUNT", PAGE])
            cursor, flat = reply[0], reply[1]
            for j in range(0, len(flat), 2):
                at = plans.get(flat[j + 1])
                if at is None:
                    at = plans[flat[j + 1]] = len(plans)
                packed.append(int(flat[j], 16) << 8 | at)
            if cursor in (b"0", "0", 0):
                return version, packed, [_text(plan) for plan in plans]

    async def follow(self, table: KeyTable) -> bool:
        """Bring `table` up to date; True if anything changed."""
        version, changed = await self.changes(table.version)
        if table.loaded and version == table.version and changed is not None:
            return False
        if not table.loaded:
            changed = None  # the first read is whole
        if changed is None:
            version, packed, plans = await self.read_all()
            table.load_packed(packed, plans, version)
        else:
            table.apply(changed, version)
        return True
