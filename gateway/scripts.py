"""Lua scripts, read from the package (or written from its fragments), known by their SHA1.

Runners (gateway.redis) call them with EVALSHA; a NOSCRIPT reply (after SCRIPT FLUSH, a restart or
a failover to a server that never saw the script) is answered with SCRIPT LOAD and the call sent
again, so no caller sees it.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path


def read_script(name: str) -> str:
    try:
        return resources.files("gateway.lua").joinpath(f"{name}.lua").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parent.parent / "lua" / f"{name}.lua").read_text()


class Script:
    def __init__(self, name: str, source: str | None = None) -> None:
        self.name = name
        self.source = read_script(name) if source is None else source
        self.sha = hashlib.sha1(self.source.encode()).hexdigest().encode()
