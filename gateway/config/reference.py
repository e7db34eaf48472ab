"""docs/configuration.md: the reference table of every routes.yaml key, generated from the field table.

    python -m gateway.config.reference > docs/configuration.md

tests/test_schema.py fails while the checked-in file differs from what this prints.
"""

from __future__ import annotations

from gateway.config.fields import PLACES, Algorithm, Field, Place, fields, parameters
from gateway.config.kinds import ListOf, Named, Section
from gateway.settings import OPTIONS

HEADER = """\
# routes.yaml reference

Every key of routes.yaml, where it may appear, what it holds and its default. The walk-through with
examples is in the [README](../README.md#routesyaml-walked-through); `gateway check routes.yaml`
validates a file and names the file, line and key of every problem.

Any value may instead be `${NAME}` or `${NAME:-default}`, replaced from the environment before it is
typed. Durations: `ms`, `s`, `m` or `min`, `h`, `d` (`50ms`, `15min`). Rates: `N/s`, `N/min`, `N/h`,
`N/d`. Any key of `defaults` may also be set on a route.

<!-- Generated from gateway/config/fields.py by `python -m gateway.config.reference`; do not edit. -->
"""


def _kind(f: Field) -> str:
    kind = f.kind
    if isinstance(kind, Section):
        return f"[{kind.place}](#{kind.place})"
    if isinstance(kind, Named):
        return f"name: [{kind.place}](#{kind.place})"
    if isinstance(kind, ListOf) and isinstance(kind.item, Section):
        return f"list of [{kind.item.place}](#{kind.item.place})"
    return _cell(kind.describe())


def _default(f: Field) -> str:
    if f.required is not None:
        return "required" + (" (proxy)" if f.proxy_only else "")
    if f.needed_by:
        return "required by " + ", ".join(f"`{a}`" for a in f.needed_by)
    if f.optional_for:
        return f"optional for {', '.join(f'`{a}`' for a in f.optional_for)}; default {f.shown or 'none'}"
    shown = f.shown_default()
    return f"`{shown}`" if shown is not None else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    out = [HEADER]
    for place in Place:
        out += [f"## {place.value}", "", PLACES[place], "",
                "| key | holds | default | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{f.key}` | {_kind(f)} | {_default(f)} | {_cell(f.doc)} |" for f in fields(place)]
        out.append("")
    out += ["## algorithms", "", "The parameters each `algorithm` of a rule takes (README: the algorithms).", "",
            "| algorithm | needs | may take |", "| --- | --- | --- |"]
    for algorithm in Algorithm:
        needed, optional = parameters(algorithm)
        out.append(f"| `{algorithm}` | {', '.join(needed)} | {', '.join(optional)} |")
    out += ["", "## process settings", "",
            "`gateway serve`'s own settings, outside routes.yaml: a flag wins over the environment variable, "
            "which wins over the default. The Helm chart sets the ones with a chart value "
            "(helm/gateway/values.yaml). Made from gateway/settings.py's OPTIONS, as `--help` is.", "",
            "| flag | environment | default | chart value | meaning |", "| --- | --- | --- | --- | --- |"]
    for option in OPTIONS:
        flag = f"`{option.flag}`" if option.switch else f"`{option.flag} {option.shown_metavar}`" if option.flag else ""
        chart = f"`{option.chart}`" if option.chart else ""
        out.append(f"| {flag} | `{option.env}` | {_cell(option.shown_default())} | {chart} | {_cell(option.help)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
