"""API keys, their plans and consumers at runtime (`keys:` in routes.yaml; the admin port's /keys).

A key is never stored: Redis holds its digest (BLAKE2b-64, personalised, 16 hex digits: its
fingerprint, `kf_...`, which logs and listings show) and its plan, with its consumer when it names
one (`pro acme`: a key without one is a consumer of its own, named by its fingerprint), in one hash
under the `{~keys}` tag, with a list of the last changes and a version counter beside it, so a worker
reads only what changed. Beside them, under the same tag, each key's metadata (a small JSON object)
and each named consumer's keys (a sorted set read by range), which only the admin port reads. Every
write also bumps the deployment's change signal (gateway/overrides.py), which every worker reads once
a second: a change applies everywhere within about a second, with no Redis call per request. A worker
keeps every key as three parallel arrays, the digests sorted (8 bytes each), their plans (1 byte
each) and their consumers (4 bytes each, 0 for a key's own): 13 bytes a key, and a lookup, plan and
consumer at once, is one binary search (docs/api-keys.md has the numbers for 1M keys).
"""

from __future__ import annotations

import bisect
import json
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.keys import FINGERPRINT, digest, fingerprint, from_fingerprint
from gateway.scripts import Script

if TYPE_CHECKING:
    from gateway.limiter import Limiter

__all__ = ["FINGERPRINT", "KeyEntry", "KeyStore", "KeyTable", "digest", "fingerprint", "from_fingerprint"]

WRITE = Script("keys_write")
CHANGED = Script("overrides_changes")  # the same list-and-version layout as a rule's overrides
CHANGES = 1000  # changes listed; a worker further behind reads the hash whole
PAGE = 10_000   # keys read per call when read whole
MAX_KEY_BYTES = 1024
MAX_BULK = 10_000  # keys in one POST /keys
KEEP = "*"  # keys_write.lua: keep the consumer or metadata the key has (no consumer is named so)


def split_value(value: str) -> tuple[str, str]:
    """A stored value's plan and consumer ("" for the key's own)."""
    plan, _, consumer = value.partition(" ")
    return plan, consumer


class KeyTable:
    """Every registered key of the deployment, as digests sorted with their plans and consumers."""

    def __init__(self) -> None:
        self.digests = array("Q")
        self.plan_of = array("B")
        self.consumer_of = array("I")        # 0: the key is its own consumer
        self.plans: list[str] = []            # plan index -> name
        self.index: dict[str, int] = {}       # name -> plan index
        self.consumers: list[str] = [""]      # consumer index -> name
        self.consumer_index: dict[str, int] = {"": 0}
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

    def _consumer_index(self, consumer: str) -> int:
        at = self.consumer_index.get(consumer)
        if at is None:
            at = self.consumer_index[consumer] = len(self.consumers)
            self.consumers.append(consumer)
        return at

    def lookup(self, key: bytes) -> tuple[str, str] | None:
        """The key's plan and consumer (its fingerprint when it is its own), or None when it is not
        registered."""
        value = digest(key)
        at = bisect.bisect_left(self.digests, value)
        if at < len(self.digests) and self.digests[at] == value:
            consumer = self.consumer_of[at]
            return self.plans[self.plan_of[at]], self.consumers[consumer] if consumer else fingerprint(value)
        return None

    def plan(self, key: bytes) -> str | None:
        """The key's plan, or None when it is not registered."""
        found = self.lookup(key)
        return None if found is None else found[0]

    def _packed_value(self, value: str) -> int:
        plan, consumer = split_value(value)
        return self._consumer_index(consumer) << 8 | self._plan_index(plan)

    def load(self, pairs: Iterable[tuple[int, str]], version: int) -> None:
        """Replace every key: (digest, stored value) pairs, a value a plan or "PLAN CONSUMER"."""
        self.plans, self.index = [], {}
        self.consumers, self.consumer_index = [""], {"": 0}
        packed = [value << 40 | self._packed_value(stored) for value, stored in pairs]
        self.load_packed(packed, list(self.plans), list(self.consumers), version)

    def load_packed(self, packed: list[int], plans: list[str], consumers: list[str], version: int) -> None:
        """Replace every key: each `digest << 40 | consumer index << 8 | plan index` (into `consumers`,
        whose first is "", and `plans`), sorted here in place (one list of ints sorts several times
        faster than tuples)."""
        packed.sort()
        self.plans, self.index = list(plans), {plan: at for at, plan in enumerate(plans)}
        self.consumers = list(consumers)
        self.consumer_index = {consumer: at for at, consumer in enumerate(consumers)}
        self.digests = array("Q", [value >> 40 for value in packed])
        self.plan_of = array("B", [value & 255 for value in packed])
        self.consumer_of = array("I", [value >> 8 & 0xFFFFFFFF for value in packed])
        self.version = version
        self.loaded = True

    def apply(self, changes: Mapping[int, str | None], version: int) -> None:
        """Set (a stored value: a plan and maybe a consumer) or remove (None) each digest."""
        for value, stored in changes.items():
            at = bisect.bisect_left(self.digests, value)
            present = at < len(self.digests) and self.digests[at] == value
            if stored is None:
                if present:
                    del self.digests[at]
                    del self.plan_of[at]
                    del self.consumer_of[at]
                continue
            plan, consumer = split_value(stored)
            if not present:
                self.digests.insert(at, value)
                self.plan_of.insert(at, 0)
                self.consumer_of.insert(at, 0)
            self.plan_of[at] = self._plan_index(plan)
            self.consumer_of[at] = self._consumer_index(consumer)
        self.version = version


@dataclass(frozen=True)
class KeyEntry:
    """What a key is registered with: its plan, its consumer (None: its own) and its metadata. A write
    may keep the consumer or the metadata the key has (`keep_consumer`, `keep_metadata`)."""

    plan: str
    consumer: str | None = None
    metadata: Mapping[str, Any] | None = None
    keep_consumer: bool = False
    keep_metadata: bool = False

    def args(self) -> list[str]:
        """The plan, consumer and metadata as keys_write.lua takes them."""
        metadata = json.dumps(self.metadata, separators=(",", ":"), ensure_ascii=False) if self.metadata else ""
        return [self.plan, KEEP if self.keep_consumer else self.consumer or "",
                KEEP if self.keep_metadata else metadata]


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
        return [f"{tag}:plans", f"{tag}:changes", f"{tag}:versions", f"{tag}:metadata", f"{tag}:consumers"]

    async def write(self, entries: Mapping[int, str | KeyEntry | None]) -> tuple[int, int]:
        """Set or remove (None) each digest's entry (a plan alone: its own consumer, no metadata) in
        one call: the new version, and how many of the digests were registered before."""
        args: list[str | int] = [CHANGES]
        for value, entry in entries.items():
            if isinstance(entry, str):
                entry = KeyEntry(entry)
            args += [f"{value:016x}", *(entry.args() if entry else ["", "", ""])]
        reply = await self.limiter.run_script(WRITE, self._keys, args)
        return int(reply[0]), int(reply[1])

    async def _command(self, at: int, *args: str | int) -> Any:
        from gateway.overrides import COMMAND

        return await self.limiter.run_script(COMMAND, [self._keys[at]], list(args))

    async def entry(self, value: int) -> KeyEntry | None:
        """A key's plan, consumer (its fingerprint when it is its own) and metadata; None if unknown."""
        found = await self._command(0, "HGET", f"{value:016x}")
        if found is None:
            return None
        plan, consumer = split_value(_text(found))
        metadata = await self._command(3, "HGET", f"{value:016x}")
        return KeyEntry(plan, consumer or fingerprint(value), json.loads(_text(metadata)) if metadata else {})

    async def plan(self, value: int) -> str | None:
        found = await self._command(0, "HGET", f"{value:016x}")
        return None if found is None else split_value(_text(found))[0]

    async def consumer_keys(self, consumer: str, limit: int) -> list[int]:
        """The digests of a named consumer's keys, at most `limit` (a key's own consumer is not
        listed here: its one key is named by the consumer's name)."""
        found = await self._command(4, "ZRANGEBYLEX", f"[{consumer} ", f"({consumer}!", "LIMIT", 0, limit)
        return [int(_text(member).rpartition(" ")[2], 16) for member in found]

    async def entries(self, values: list[int]) -> list[KeyEntry | None]:
        """Each digest's entry, as `entry` reads one, in two calls."""
        if not values:
            return []
        fields = [f"{value:016x}" for value in values]
        stored = await self._command(0, "HMGET", *fields)
        metadata = await self._command(3, "HMGET", *fields)
        out: list[KeyEntry | None] = []
        for value, found, meta in zip(values, stored, metadata, strict=True):
            if found is None:
                out.append(None)
                continue
            plan, consumer = split_value(_text(found))
            out.append(KeyEntry(plan, consumer or fingerprint(value), json.loads(_text(meta)) if meta else {}))
        return out

    async def page(self, cursor: str, count: int) -> tuple[str, list[tuple[int, str]]]:
        from gateway.overrides import COMMAND

        reply = await self.limiter.run_script(COMMAND, [self._keys[0]], ["HSCAN", cursor, "COUNT", count])
        flat = reply[1]
        return _text(reply[0]), [(int(_text(flat[j]), 16), split_value(_text(flat[j + 1]))[0])
                                 for j in range(0, len(flat), 2)]

    async def changes(self, since: int) -> tuple[int, dict[int, str | None] | None]:
        reply = await self.limiter.run_script(CHANGED, self._keys[:3], ["keys", since])
        version, listed, flat = int(reply[0]), int(reply[1]), reply[2:]
        if not listed:
            return version, None
        return version, {int(_text(flat[j]), 16): None if flat[j + 1] is None else _text(flat[j + 1])
                         for j in range(0, len(flat), 2)}

    async def read_all(self) -> tuple[int, list[int], list[str], list[str]]:
        """The version (read first: a change meanwhile is read next time) and every key, packed as
        `KeyTable.load_packed` takes them, with its plans and consumers."""
        from gateway.overrides import COMMAND

        version, _ = await self.changes(-1)  # -1: never listed, so only the version comes back
        packed: list[int] = []
        low: dict[bytes, int] = {}  # a stored value -> its consumer index << 8 | its plan index
        plans: dict[str, int] = {}
        consumers: dict[str, int] = {"": 0}
        cursor = b"0"
        while True:
            reply = await self.limiter.run_script(COMMAND, [self._keys[0]], ["HSCAN", cursor, "COUNT", PAGE])
            cursor, flat = reply[0], reply[1]
            for j in range(0, len(flat), 2):
                bits = low.get(flat[j + 1])
                if bits is None:
                    plan, consumer = split_value(_text(flat[j + 1]))
                    bits = low[flat[j + 1]] = (consumers.setdefault(consumer, len(consumers)) << 8
                                               | plans.setdefault(plan, len(plans)))
                packed.append(int(flat[j], 16) << 40 | bits)
            if cursor in (b"0", "0", 0):
                return version, packed, list(plans), list(consumers)

    async def follow(self, table: KeyTable) -> bool:
        """Bring `table` up to date; True if anything changed."""
        version, changed = await self.changes(table.version)
        if table.loaded and version == table.version and changed is not None:
            return False
        if not table.loaded:
            changed = None  # the first read is whole
        if changed is None:
            version, packed, plans, consumers = await self.read_all()
            table.load_packed(packed, plans, consumers, version)
        else:
            table.apply(changed, version)
        return True
