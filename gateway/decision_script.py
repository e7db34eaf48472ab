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
import struct
from collections.abc import Sequence
from string import Template
from typing import NamedTuple

from gateway.calendars import KINDS, LONGEST_EXTRA, NOMINAL, offset_tree
from gateway.config import BUCKET_ALGORITHMS, MAX_RULES, Rule, shard_share
from gateway.scripts import Script, read_script

EXACT = 2**53  # Lua numbers are doubles: integers below this are exact


class RuleSpec(NamedTuple):
    """What the script needs of a rule: all µs and whole units; p2 = 0 is a quota without period.

    `base`: set on a per-identity override (gateway/overrides.py): the file's spec, which shapes
    the script; this spec's numbers then reach the script as ARGV (see `override_params`), so every
    override of a route's rules shares one script."""

    algorithm: str
    p1: int      # limit (windows, quota) or burst (buckets)
    p2: int      # window / period, or a bucket's emission interval
    shadow: bool
    charge: bool = True   # an admission writes; False: checked now, charged after the answer
    force: bool = False   # the settling script: the cost is taken (or given back) whatever the room
    base: RuleSpec | None = None  # an override's: the file's spec (above)
    calendar: str = ""    # a calendar period, "month@Europe/Berlin" (gateway/calendars.py); p2 is its longest

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
    if rule.calendar_period is not None:
        longest = (NOMINAL[rule.calendar_period] + LONGEST_EXTRA) * 1_000_000
        return RuleSpec(rule.algorithm, shard_share(rule.limit, shards, shard), longest, rule.shadow, charge,
                        calendar=f"{rule.calendar_period}@{rule.calendar}")
    return RuleSpec(rule.algorithm, shard_share(rule.limit, shards, shard), round(rule.window * 1_000_000),
                    rule.shadow, charge)


# sliding_window keeps its window number modulo 10^d in its value; when 10^d windows span at least
# this long, a state from the future (the clock stepped back) is told by the value alone, and the
# key's TTL is never read (lua/decide.lua)
EXACT_SPAN_US = 86_400 * 1_000_000


def sliding_window_digits(limit: int) -> int:
    """d, the digits of the window number in a sliding window's 19-digit value (lua/decide.lua):
    what cantor(current, previous) leaves of 18, at most 8 (1 past 2^24: a string is written)."""
    if limit >= 2**24:
        return 1
    most = 2 * limit
    return min(8, 18 - len(str(most * (most + 1) // 2 + limit)))


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


def write_script(specs: tuple[RuleSpec, ...], peek: bool, overridden: frozenset[int] = frozenset()
                 ) -> tuple[str, Layout]:
    """The Lua source deciding `specs` (KEYS and ARGV one per rule, in order) and its reply layout.

    `overridden`: the (0-based) rules whose numbers come from the ARGV after the costs: PARAMS
    doubles per rule, in order, packed little-endian in one string (`override_params`,
    `overridden_script`); their part of the reply is always two integers."""
    n = len(specs)
    if n > MAX_RULES:  # Lua allows 200 locals per function: 32 rules use at most 141
        raise ValueError(f"at most {MAX_RULES} rules per script")
    slots: list[tuple[int, int]] = []
    mosts: list[int] = []
    index = 2
    for j, spec in enumerate(specs):
        most, longest = _most_and_longest(spec)
        radix = math.ceil(longest / 1000) + 2 if longest >= 0 else 1
        packed = ((most + 1) * radix) * 4 < EXACT and j not in overridden
        slots.append((index - 1, radix if packed else 0))
        mosts.append(most)
        index += 1 if packed else 2
    peek_lua = "true" if peek else "false"
    delays = any(spec.algorithm == "leaky_bucket" and not spec.shadow for spec in specs)
    parts = [FRAGMENTS["head"].substitute(
        keys=", ".join(f"KEYS[{i}]" for i in range(1, n + 1)),
        slots=", ".join(["0" if delays else "1"] + ["0"] * (index - 2)),
        delay_local=", delay" if delays else "", delay_zero=", 0" if delays else "",
    )]
    if any(spec.algorithm == "sliding_window" for spec in specs):
        parts.append(FRAGMENTS["locals_sliding_window"].substitute())
    calendars = {c: k for k, c in enumerate(dict.fromkeys(spec.calendar for spec in specs if spec.calendar))}
    for calendar, k in calendars.items():
        period, zone = calendar.split("@", 1)
        parts.append(FRAGMENTS["calendar"].substitute(c=k, kind=KINDS[period], offsets=offset_tree(zone)))
    at_param: dict[int, int] = {}  # rule -> where its numbers start in P
    if overridden:
        parts.append(FRAGMENTS["override_params"].substitute(format="<" + "d" * (PARAMS * len(overridden))))
        at_param = {j: PARAMS * k for k, j in enumerate(sorted(overridden))}
    for i, (spec, (at0, radix), most) in enumerate(zip(specs, slots, mosts, strict=True), start=1):
        given = _given(at_param.get(i - 1))
        parts.append(_rule(i, spec, peek_lua, n, given, calendars))
        parts.append(_verdict(i, spec, given.get("most", most), at0 + 1, radix))
    if not peek:
        repairs = [w for i, spec in enumerate(specs, start=1) if (w := _repair(i, spec))]
        writes = [_write(i, spec, n, _given(at_param.get(i - 1))) for i, spec in enumerate(specs, start=1)]
        parts.extend(repairs)
        parts.append("if not refused then\n" + "".join(writes) + "end\n")
    parts.append(FRAGMENTS["tail"].substitute(
        admitted="else\n  out[1] = (delay + (-delay) % 1000) / 1000 * 2 + 1" if delays else ""))
    return _simplified("".join(parts)), Layout(tuple(slots))


def _simplified(source: str) -> str:
    """The script without the tests of constants its fragments leave (`@force` false in a
    condition, `@charge` true): Lua compiles no constant conditions away, and runs every line."""
    for constant, gone in ((" or false then", " then"), (" and true then", " then"), (" or false or ", " or "),
                           (" or false)", ")")):
        source = source.replace(constant, gone)
    return source


def _verdict(i: int, spec: RuleSpec, most: int | str, at: int, radix: int) -> str:
    """The rule's part of the reply, at out[at] (packed by `radix`) or out[at], out[at + 1]: a
    shadow rule never refuses; only a leaky bucket delays; only a quota without period has no reset
    (-1: rs 0, and packed its radix is 1)."""
    never_resets = spec.algorithm == "quota" and spec.p2 == 0
    rs = "0" if never_resets else "(reset + (-reset) % 1000) / 1000 + 1"
    if not radix:
        reply = f"out[{at}], out[{at + 1}] = remaining, rs * 4 + outcome"
    elif never_resets:
        reply = f"out[{at}] = remaining * 4 + outcome"
    else:
        reply = f"out[{at}] = (remaining * {radix} + rs) * 4 + outcome"
    if spec.shadow:
        return FRAGMENTS["verdict_shadow"].substitute(most=most, rs=rs, reply=reply)
    delay = "  elseif wait > delay then\n    delay = wait" if spec.algorithm == "leaky_bucket" else ""
    return FRAGMENTS["verdict"].substitute(i=i, most=most, rs=rs, reply=reply, delay=delay)


def _last_ms(window: int | str) -> str:
    """Lua: the last millisecond of the window after the current one (number `wid`)."""
    if isinstance(window, int) and window % 1000 == 0:
        return f"((wid + 2) * {window // 1000} - 1)"
    return f"(((wid + 2) * {window} + (-(wid + 2) * {window}) % 1000) / 1000 - 1)"


def _read_own_digits(digits: int, window: int | str, modulus: int, mine: bool = True) -> str:
    """Lua reading a sliding window's 19-digit value `v`: its d, and when d is this rule's own, all
    its digits by one string.byte (no substring, no strtod), the pair's and the window number's in
    turn. Only where the pair's digits add up below 2^53 before the '0's are taken off (d >= 3);
    else every d takes the general path. `mine`: the value is this script's own layout (not in an
    override's script, which reads the file's value but writes its own)."""
    if digits < 3:
        return "      local d = byte(v) - 48\n      if false then"
    names = [f"c{k}" for k in range(1, 20)]

    def number(digit_names: list[str]) -> str:
        expr = digit_names[0]
        for name in digit_names[1:]:
            expr = f"({expr}) * 10 + {name}" if expr != digit_names[0] else f"{expr} * 10 + {name}"
        return f"{expr} - {48 * int('1' * len(digit_names))}"

    exact = (str(modulus * window >= EXACT_SPAN_US).lower() if isinstance(window, int)
             else f"{modulus} * {window} >= {EXACT_SPAN_US}")
    return "\n".join([
        f"      local {', '.join(names)} = byte(v, 1, 19)",
        "      local d = c1 - 48",
        f"      if d == {digits} then   -- this rule's own d",
        f"        num, lo = {number(names[1:19 - digits])}, {number(names[19 - digits:])}",
        f"        if num >= 0 and lo >= 0 and lo < {modulus} then",
        f"          rel, exact, mine = (wid - lo) % {modulus}, {exact}, {1 if mine else 'false'}",
        "        else",
        "          num = nil",
        "        end",
    ])


def _lua(value: bool) -> str:
    return "true" if value else "false"


PARAMS = 5  # numbers per overridden rule in ARGV: p1, p2, span or float slack, most ahead, most


def _given(at: int | None) -> dict[str, str]:
    """An overridden rule's numbers as Lua expressions into P (the ARGV after the costs), or {}."""
    if at is None:
        return {}
    p1, p2, third, ahead, most = (f"P[{at + k}]" for k in range(1, PARAMS + 1))
    return {"p1": p1, "p2": p2, "span": third, "float_slack": third, "most_ahead": ahead, "most": most}


def override_params(spec: RuleSpec) -> tuple[int, int, int, int, int]:
    """The PARAMS numbers an overridden rule's script reads from ARGV, for the spec it runs with."""
    most, longest = _most_and_longest(spec)
    if spec.algorithm in BUCKET_ALGORITHMS:
        return spec.p1, spec.p2, spec.p1 * spec.p2, longest, most
    slack = math.ceil(spec.p1 * spec.p2 / 2**51) if spec.p1 * spec.p2 > 2**52 else 0
    return spec.p1, spec.p2, slack, 0, most


def _rule(i: int, spec: RuleSpec, peek: str, n: int, given: dict[str, str] | None = None,
          calendars: dict[str, int] | None = None) -> str:
    algorithm, p1, p2 = spec.algorithm, spec.p1, spec.p2
    modes = {"charge": _lua(spec.charge), "force": _lua(spec.force)}
    given = given or {}
    g1, g2 = given.get("p1", p1), given.get("p2", p2)
    if algorithm in BUCKET_ALGORITHMS:
        _, most_ahead = _most_and_longest(spec)
        read = FRAGMENTS["bucket_read"].substitute(i=i, most_ahead=given.get("most_ahead", most_ahead)).rstrip("\n")
        leaky = algorithm == "leaky_bucket"
        return FRAGMENTS["bucket"].substitute(
            i=i, burst=g1, step=g2, span=given.get("span", p1 * p2), read_state=read,
            plus_queue=" + 1" if leaky else "", minus_queue=" - 1" if leaky else "",
            wait_local=", wait" if leaky else "", admit="ok, wait = true, ahead" if leaky else "ok = true", **modes)
    if algorithm == "quota" and p2 == 0:
        return FRAGMENTS["quota"].substitute(i=i, limit=g1, **modes)
    if algorithm == "concurrency":
        return FRAGMENTS["concurrency"].substitute(i=i, limit=g1, n=n, **modes)
    if algorithm in ("fixed_window", "quota"):
        stop = f"cal_next{calendars[spec.calendar]}(now)" if spec.calendar and calendars else f"now - now % {g2} + {g2}"
        return FRAGMENTS["window_count"].substitute(i=i, limit=g1, window=g2, peek=peek, stop=stop, **modes)
    if algorithm == "sliding_window" and given:
        # the state's numbers are the file's rule's: read in its format, written as
        # "window:current:previous" (any limit; the window zero-padded, so never 19 characters
        # long and never read as the packed format), which the file's script reads too
        digits = sliding_window_digits(p1)  # the file's script's (any is read: the value says its own)
        return FRAGMENTS["sliding_window"].substitute(
            i=i, limit=g1, window=g2, peek=peek, pack_state="fmt('%020d:%d:%d', wid, c, prev)",
            float_slack=given["float_slack"], read_own=_read_own_digits(digits, g2, 10**digits, mine=False),
            last_ms=_last_ms(g2), incr="nil", exact_span=EXACT_SPAN_US, **modes)
    if algorithm == "sliding_window":
        digits = sliding_window_digits(p1)
        if p1 < 2**24:
            pack = (f"fmt('{digits}%0{18 - digits}d%0{digits}d', (c + prev) * (c + prev + 1) / 2 + prev, "
                    f"wid % {10 ** digits})")
        else:
            pack = "fmt('%d:%d:%d', wid, c, prev)"
        # floats lose exactness past 2^52: a retry rounded up by their step stays honest
        slack = math.ceil(p1 * p2 / 2**51) if p1 * p2 > 2**52 else 0
        return FRAGMENTS["sliding_window"].substitute(
            i=i, limit=p1, window=p2, peek=peek, pack_state=pack, float_slack=slack,
            read_own=_read_own_digits(digits, p2, 10**digits), last_ms=_last_ms(p2),
            incr=f"fmt('%d{'0' * digits}', delta)", exact_span=EXACT_SPAN_US, **modes)
    assert algorithm == "sliding_log", algorithm
    return FRAGMENTS["sliding_log"].substitute(i=i, limit=g1, window=g2, **modes)


def _repair(i: int, spec: RuleSpec) -> str:
    """The write that cuts state from the future back (the clock stepped backwards), or ''."""
    if spec.algorithm in BUCKET_ALGORITHMS:
        return FRAGMENTS["bucket_write"].substitute(i=i, value=f"f{i}")
    if spec.algorithm == "sliding_log":
        return FRAGMENTS["sliding_log_repair"].substitute(i=i)
    if (spec.algorithm == "quota" and spec.p2 == 0) or spec.algorithm == "concurrency":
        return ""
    return FRAGMENTS["set_until"].substitute(i=i, value=f"f{i}", until=f"g{i}")


def _write(i: int, spec: RuleSpec, n: int, given: dict[str, str] | None = None) -> str:
    if spec.algorithm == "concurrency":  # the file's lease: leases are renewed by it (lua/leases.lua)
        return FRAGMENTS["concurrency_write"].substitute(i=i, lease=spec.p2, n=n)
    if spec.algorithm in BUCKET_ALGORITHMS:
        return FRAGMENTS["bucket_write"].substitute(i=i, value=f"a{i}")
    if spec.algorithm == "sliding_log":
        return FRAGMENTS["sliding_log_write"].substitute(i=i, window=(given or {}).get("p2", spec.p2))
    if spec.algorithm == "quota" and spec.p2 == 0:
        return FRAGMENTS["quota_write"].substitute(i=i)
    if spec.algorithm == "sliding_window":
        return FRAGMENTS["sliding_window_write"].substitute(i=i)
    return FRAGMENTS["set_until"].substitute(i=i, value=f"a{i}", until=f"b{i}")


class DecisionScript(NamedTuple):
    script: Script
    layout: Layout
    params: tuple[bytes, ...] = ()  # ARGV after the costs: the overridden rules' numbers, packed


def decision_script(specs: tuple[RuleSpec, ...], peek: bool = False) -> DecisionScript:
    source, layout = write_script(specs, peek)
    return DecisionScript(Script(f"decide:{len(specs)}", source), layout)


def override_shape(specs: tuple[RuleSpec, ...]) -> tuple[tuple[RuleSpec, ...], frozenset[int]]:
    """The script shape of a route's specs where some are overrides: each overridden rule's file spec
    (a quota's with the override's choice of period or none: the fragment differs), and which."""
    shape, overridden = [], set()
    for j, spec in enumerate(specs):
        if spec.base is None:
            shape.append(spec)
            continue
        overridden.add(j)
        base = spec.base
        if base.algorithm == "quota" and (base.p2 == 0) != (spec.p2 == 0):
            base = base._replace(p2=spec.p2)
        shape.append(base._replace(shadow=spec.shadow, charge=spec.charge, force=spec.force))
    return tuple(shape), frozenset(overridden)


def overridden_script(specs: tuple[RuleSpec, ...], shaped: DecisionScript) -> DecisionScript:
    """The script of `specs` with overrides: `shaped` (the script of their shape) and their numbers."""
    numbers = [n for spec in specs if spec.base is not None for n in override_params(spec)]
    # doubles, as Lua's numbers are (all below 2^53: exact): struct.unpack reads them at a fraction
    # of what tonumber's strtod costs on text
    return shaped._replace(params=(struct.pack(f"<{len(numbers)}d", *numbers),))


def shape_script(shape: tuple[RuleSpec, ...], overridden: frozenset[int], peek: bool = False) -> DecisionScript:
    source, layout = write_script(shape, peek, overridden)
    return DecisionScript(Script(f"decide:{len(shape)}:overridden", source), layout)


# --- one script for rules of any kinds ------------------------------------------------------------

Kind = tuple[str, bool, str]  # (fragment, shadow, calendar)


def kind_of(spec: RuleSpec) -> Kind:
    """Which branch of the generic script runs `spec` (its numbers come from ARGV)."""
    algorithm = spec.algorithm
    if algorithm in ("leaky_bucket", "concurrency") or not spec.charge or spec.force:
        raise ValueError(f"{algorithm} (charge {spec.charge}, force {spec.force}) has no generic form")
    if algorithm in BUCKET_ALGORITHMS:
        return "bucket", spec.shadow, ""
    if algorithm == "quota" and spec.p2 == 0:
        return "quota", spec.shadow, ""
    if algorithm in ("fixed_window", "quota"):
        return "window", spec.shadow, spec.calendar
    return algorithm, spec.shadow, ""


def _kind_spec(kind: Kind) -> RuleSpec:
    fragment, shadow, calendar = kind
    algorithm = {"bucket": "token_bucket", "window": "fixed_window"}.get(fragment, fragment)
    return RuleSpec(algorithm, 1, 0 if fragment == "quota" else 1_000_000, shadow, calendar=calendar)


def generic_kinds(calendars: tuple[str, ...]) -> dict[Kind, int]:
    """The kinds a generic script knows and their codes (1..), in the order it tests them, the
    commonest first; a kind's shadow has its code plus half their number."""
    plain = [("window", ""), ("bucket", ""), ("sliding_window", ""), ("quota", ""), ("sliding_log", "")]
    plain += [("window", calendar) for calendar in calendars]
    kinds = [(fragment, shadow, calendar) for shadow in (False, True) for fragment, calendar in plain]
    return {kind: code for code, kind in enumerate(kinds, start=1)}


_OWN_LOCALS = re.compile(r"\Alocal ai(?:, [bfg]i)*\n")
_SLOT = 2**40  # where the reply goes, in a fragment: out[_SLOT] is out[j] (j = 2 * i) in the loop
_GIVEN = {"p1": "p1", "p2": "p2", "span": "p3", "float_slack": "p3", "most_ahead": "p4", "most": "p5"}


def _dispatch(branches: list[tuple[int, str]]) -> str:
    """Lua running the branch of the rule's kind (`k`)."""
    return "".join(f"{'if' if n == 0 else 'elseif'} k == {code} then\n{body}"
                   for n, (code, body) in enumerate(branches)) + "end\n"


def write_generic(calendars: tuple[str, ...]) -> str:
    """The Lua source deciding up to MAX_RULES rules of any kinds (`generic_kinds`), one loop over
    them, none of their numbers a constant. KEYS: one per rule; ARGV: a cost per rule, then the
    struct format of the last, one string of doubles: each rule's kind, then PARAMS numbers per rule
    (`generic_params`). Each rule replies with two integers (`generic_layout`)."""
    kinds = generic_kinds(calendars)
    at_calendar = {c: k for k, c in enumerate(calendars)}
    parts = [FRAGMENTS["head"].substitute(keys="unpack(KEYS)", slots="1, unpack(KEYS, 1, 2 * #KEYS)",
                                          delay_local="", delay_zero=""),
             FRAGMENTS["locals_sliding_window"].substitute()]
    for calendar, k in at_calendar.items():
        period, zone = calendar.split("@", 1)
        parts.append(FRAGMENTS["calendar"].substitute(c=k, kind=KINDS[period], offsets=offset_tree(zone)))
    # tables are made at their size (`out` too; unpack past the end gives nils): grown entry by
    # entry they were rehashed at each power of two, and allocations cost more than a rule's Lua
    parts.append("local n = #KEYS\n"
                 "local P = {struct.unpack(ARGV[n + 1], ARGV[n + 2])}\n"
                 "local W, R = {unpack(KEYS, 1, 2 * n)}, nil   -- per rule its write (a, b), its repair (f, g)\n")
    decide: list[tuple[int, str]] = []
    repair: list[tuple[int, str]] = []
    write: list[tuple[int, str]] = []
    for kind, code in kinds.items():
        spec = _kind_spec(kind)
        body = _rule(0, spec, "false", 0, _GIVEN, at_calendar) + _verdict(0, spec, "p5", _SLOT, 0)
        body = body.replace(f"out[{_SLOT}]", "out[j]").replace(f"out[{_SLOT + 1}]", "out[j + 1]")
        decide.append((code, _OWN_LOCALS.sub("", _indexed(body), count=1)))
        if not kind[1]:
            if fixed := _repair(0, spec):
                repair.extend((c, _indexed(fixed)) for c in (code, code + len(kinds) // 2))
            write.extend((c, _indexed(_write(0, spec, 0, _GIVEN))) for c in (code, code + len(kinds) // 2))
    parts.append("for i = 1, n do\n"
                 f"local k, o, j = P[i], n + (i - 1) * {PARAMS}, 2 * i\n"
                 "local p1, p2, p3, p4, p5 = P[o + 1], P[o + 2], P[o + 3], P[o + 4], P[o + 5]\n"
                 "out[j], out[j + 1] = 0, 0\n"
                 "local ai, bi, fi, gi\n" + _dispatch(decide) + "W[j - 1], W[j] = ai, bi\n"
                 "if fi then\nR = R or {}\nR[j - 1], R[j] = fi, gi\nend\nend\n")
    parts.append("if R then\nfor i = 1, n do\nlocal j = 2 * i\nlocal fi, gi = R[j - 1], R[j]\nif fi then\n"
                 f"local k = P[i]\n{_dispatch(repair)}end\nend\nend\n")
    parts.append("if not refused then\nfor i = 1, n do\nlocal ai, bi = W[2 * i - 1], W[2 * i]\nif ai then\n"
                 f"local k, o = P[i], n + (i - 1) * {PARAMS}\nlocal p2 = P[o + 2]\n{_dispatch(write)}end\nend\nend\n")
    parts.append(FRAGMENTS["tail"].substitute(admitted=""))
    return _simplified("".join(parts))


def _indexed(lua: str) -> str:
    """A fragment written for rule 0, made to run for the loop's rule i."""
    return re.sub(r"\b([abfg])0\b", r"\1i", lua).replace("[0]", "[i]").replace("= 0, retry", "= i, retry")


def generic_script(calendars: tuple[str, ...]) -> DecisionScript:
    return DecisionScript(Script("decide:any", write_generic(calendars)), generic_layout(0))


_FORMATS = [b"<" + b"d" * (n * (PARAMS + 1)) for n in range(MAX_RULES + 1)]
_LAYOUTS = [Layout(tuple((2 * i - 1, 0) for i in range(1, n + 1))) for n in range(MAX_RULES + 1)]


def generic_layout(rules: int) -> Layout:
    return _LAYOUTS[rules]


def generic_params(specs: Sequence[RuleSpec], kinds: dict[Kind, int]) -> tuple[bytes, bytes]:
    """The ARGV after the costs of a generic script for `specs`: the struct format of the doubles,
    and the doubles, their kinds, then their numbers."""
    numbers = [float(kinds[kind_of(spec)]) for spec in specs]
    for spec in specs:
        numbers.extend(override_params(spec))
    return _FORMATS[len(specs)], struct.pack(_FORMATS[len(specs)].decode(), *numbers)
