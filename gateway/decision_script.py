"""One decision script per route (and a read-only one per rule, for the admin port), written from
the fragments of lua/decide.lua.

Each rule's algorithm and parameters become constants of the script, so a call sends its keys and
its costs and nothing else, and Redis runs straight-line code for exactly those rules. The reply is
packed into one integer per rule where the numbers fit (see lua/decide.lua's header) and unpacked
by gateway.limiter into a `Decision`.
"""

from __future__ import annotations

import math
import re
from string import Template
from typing import NamedTuple

from gateway.config import BUCKET_ALGORITHMS, MAX_RULES, Rule, shard_share
from gateway.scripts import Script, read_script

EXACT = 2**53  # Lua numbers are doubles: integers below this are exact


class RuleSpec(NamedTuple):
    """What the script needs of a rule: all µs and whole units; p2 = 0 is a quota without period."""

    algorithm: str
    p1: int      # limit (windows, quota) or burst (buckets)
    p2: int      # window / period, or a bucket's emission interval
    shadow: bool
    charge: bool = True   # an admission writes; False: checked now, charged after the answer
    force: bool = False   # the settling script: the cost is taken (or given back) whatever the room

    def settling(self) -> RuleSpec:
        """This rule in the script that charges and refunds after the answer."""
        return self._replace(charge=True, force=True)


def rule_spec(rule: Rule, shards: int = 1, shard: int = 0) -> RuleSpec:
    """The rule as the script runs it; with `shards` > 1, shard `shard`'s share of a split rule:
    its limit or burst by `shard_share` (the shares add up to the rule's), its rate rate/shards."""
    charge = not rule.charged_after
    if rule.algorithm == "concurrency":
        return RuleSpec(rule.algorithm, shard_share(rule.limit, shards, shard), round(rule.lease * 1_000_000),
                        rule.shadow, charge)
    if rule.algorithm in BUCKET_ALGORITHMS:
        # whole microseconds, rounded up: never more than the rate (nor, summed, than the rule's)
        step = max(1, math.ceil(float(repr(1_000_000 * shards / rule.rate)) - 1e-6))
        return RuleSpec(rule.algorithm, shard_share(rule.burst, shards, shard), step, rule.shadow, charge)
    return RuleSpec(rule.algorithm, shard_share(rule.limit, shards, shard), round(rule.window * 1_000_000),
                    rule.shadow, charge)


# sliding_window keeps its window number modulo 10^d in its value; when 10^d windows span at least
# this long, a state from the future (the clock stepped back) is told by the value alone, and the
# key's TTL is never read (lua/decide.lua)
EXACT_SPAN_US = 86_400 * 1_000_000


class _Dollar(Template):
    delimiter = "@"


def _fragments() -> dict[str, _Dollar]:
    parts = re.split(r"^--@@ (\w+)\n", read_script("decide"), flags=re.MULTILINE)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        code = [line for line in body.rstrip().split("\n") if not line.lstrip().startswith("--")]
        out[name] = _Dollar("\n".join(code) + "\n")  # whole-line comments stay in the source
    return out


FRAGMENTS = _fragments()


class Layout(NamedTuple):
    """Where each rule's numbers are in the reply: (0-based index, radix); radix 0 = two integers."""

    slots: tuple[tuple[int, int], ...]


def _most_and_longest(spec: RuleSpec) -> tuple[int, int]:
    """The largest `remaining` a rule reports and its longest reset in µs (-1: never resets)."""
    if spec.algorithm == "leaky_bucket":
        return spec.p1 + 1, (spec.p1 + 1) * spec.p2
    if spec.algorithm in BUCKET_ALGORITHMS:
        return spec.p1, spec.p1 * spec.p2
    if spec.algorithm == "concurrency":
        return spec.p1, 1_000_000  # reset: a second (no honest time exists)
    return spec.p1, spec.p2 if spec.p2 > 0 else -1


def write_script(specs: tuple[RuleSpec, ...], peek: bool) -> tuple[str, Layout]:
    """The Lua source deciding `specs` (KEYS and ARGV one per rule, in order) and its reply layout."""
    n = len(specs)
    if n > MAX_RULES:  # Lua allows 200 locals per function: 32 rules use at most 141
        raise ValueError(f"at most {MAX_RULES} rules per script")
    slots: list[tuple[int, int]] = []
    mosts: list[int] = []
    index = 2
    for spec in specs:
        most, longest = _most_and_longest(spec)
        radix = math.ceil(longest / 1000) + 2 if longest >= 0 else 1
        packed = ((most + 1) * radix) * 4 < EXACT
        slots.append((index - 1, radix if packed else 0))
        mosts.append(most)
        index += 1 if packed else 2
    peek_lua = "true" if peek else "false"
    parts = [FRAGMENTS["head"].substitute(
        keys=", ".join(f"KEYS[{i}]" for i in range(1, n + 1)),
        slots=", ".join("0" for _ in range(index - 1)),
    )]
    for i, (spec, (at0, radix), most) in enumerate(zip(specs, slots, mosts, strict=True), start=1):
        at = at0 + 1
        reply = (f"out[{at}] = (remaining * {radix} + rs) * 4 + outcome" if radix
                 else f"out[{at}], out[{at + 1}] = remaining, rs * 4 + outcome")
        parts.append(_rule(i, spec, peek_lua, n))
        parts.append(FRAGMENTS["verdict"].substitute(
            i=i, shadow="true" if spec.shadow else "false", most=most, reply=reply))
    if not peek:
        repairs = [w for i, spec in enumerate(specs, start=1) if (w := _repair(i, spec))]
        writes = [_write(i, spec, n) for i, spec in enumerate(specs, start=1)]
        parts.extend(repairs)
        parts.append("if not refused then\n" + "".join(writes) + "end\n")
    parts.append(FRAGMENTS["tail"].substitute())
    return "".join(parts), Layout(tuple(slots))


def _lua(value: bool) -> str:
    return "true" if value else "false"


def _rule(i: int, spec: RuleSpec, peek: str, n: int) -> str:
    algorithm, p1, p2 = spec.algorithm, spec.p1, spec.p2
    modes = {"charge": _lua(spec.charge), "force": _lua(spec.force)}
    if algorithm in BUCKET_ALGORITHMS:
        _, most_ahead = _most_and_longest(spec)
        read = FRAGMENTS["bucket_read"].substitute(i=i, most_ahead=most_ahead).rstrip("\n")
        queue = 1 if algorithm == "leaky_bucket" else 0
        return FRAGMENTS["bucket"].substitute(i=i, burst=p1, step=p2, span=p1 * p2, queue=queue, read_state=read,
                                              **modes)
    if algorithm == "quota" and p2 == 0:
        return FRAGMENTS["quota"].substitute(i=i, limit=p1, **modes)
    if algorithm == "concurrency":
        return FRAGMENTS["concurrency"].substitute(i=i, limit=p1, n=n, **modes)
    if algorithm in ("fixed_window", "quota"):
        return FRAGMENTS["window_count"].substitute(i=i, limit=p1, window=p2, peek=peek, **modes)
    if algorithm == "sliding_window":
        split = modulus = 1
        exact = "true"
        if p1 < 2**24:
            digits = len(str((p1 + 1) ** 2 - 1))  # of the largest current * (limit + 1) + previous
            split, modulus = 1 + digits, 10 ** (18 - digits)
            pack = f"fmt('1%0{digits}d%0{18 - digits}d', c * {p1 + 1} + prev, wid % {modulus}), last_ms"
            exact = "true" if modulus * p2 >= EXACT_SPAN_US else "false"
        else:
            pack = "fmt('%d:%d:%d', wid, c, prev), last_ms"
        # floats lose exactness past 2^52: a retry rounded up by their step stays honest
        slack = math.ceil(p1 * p2 / 2**51) if p1 * p2 > 2**52 else 0
        return FRAGMENTS["sliding_window"].substitute(
            i=i, limit=p1, window=p2, peek=peek, pack_state=pack, float_slack=slack, split=split, modulus=modulus,
            exact=exact, base=p1 + 1, **modes)
    assert algorithm == "sliding_log", algorithm
    return FRAGMENTS["sliding_log"].substitute(i=i, limit=p1, window=p2, **modes)


def _repair(i: int, spec: RuleSpec) -> str:
    """The write that cuts state from the future back (the clock stepped backwards), or ''."""
    if spec.algorithm in BUCKET_ALGORITHMS:
        return FRAGMENTS["bucket_write"].substitute(i=i, value=f"f{i}")
    if spec.algorithm == "sliding_log":
        return FRAGMENTS["sliding_log_repair"].substitute(i=i)
    if (spec.algorithm == "quota" and spec.p2 == 0) or spec.algorithm == "concurrency":
        return ""
    return FRAGMENTS["set_until"].substitute(i=i, value=f"f{i}", until=f"g{i}")


def _write(i: int, spec: RuleSpec, n: int) -> str:
    if spec.algorithm == "concurrency":
        return FRAGMENTS["concurrency_write"].substitute(i=i, lease=spec.p2, n=n)
    if spec.algorithm in BUCKET_ALGORITHMS:
        return FRAGMENTS["bucket_write"].substitute(i=i, value=f"a{i}")
    if spec.algorithm == "sliding_log":
        return FRAGMENTS["sliding_log_write"].substitute(i=i, window=spec.p2)
    if spec.algorithm == "quota" and spec.p2 == 0:
        return FRAGMENTS["quota_write"].substitute(i=i)
    return FRAGMENTS["set_until"].substitute(i=i, value=f"a{i}", until=f"b{i}")


class DecisionScript(NamedTuple):
    script: Script
    layout: Layout


def decision_script(specs: tuple[RuleSpec, ...], peek: bool = False) -> DecisionScript:
    source, layout = write_script(specs, peek)
    return DecisionScript(Script(f"decide:{len(specs)}", source), layout)
