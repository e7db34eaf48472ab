"""The gateway's last configuration load (start-up or reload) and how it ended, for the console.

Workers share it through the metrics directory (as gateway/top.py shares its counts): whichever
worker answers the console says what the last one to load a file saw.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from gateway.settings import metrics_dir

_own: dict[str, Any] | None = None


def _path() -> Path | None:
    directory = metrics_dir()
    return Path(directory) / "last-reload.json" if directory else None


def note(ok: bool, detail: str) -> None:
    global _own
    _own = {"at": time.time(), "ok": ok, "detail": detail[:4000]}
    path = _path()
    if path is not None:
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(_own))
            temporary.replace(path)


def last() -> dict[str, Any] | None:
    path = _path()
    if path is not None:
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(path.read_text())
            if isinstance(found, dict):
                return found
    return _own
