"""Every environment variable the gateway reads is read in gateway/settings.py: a module elsewhere
that reads one by name (os.environ.get, os.getenv, os.environ[...]) is a setting nobody can find in
the settings table. Passing the whole environment on (a child process's, the config file's ${VAR}
interpolation) is not reading a setting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gateway"


def named_reads(source: str) -> list[int]:
    """The lines of `source` that read an environment variable by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "getenv":
                target = node.func.value
            elif node.func.attr == "get" and _is_environ(node.func.value):
                found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            found.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(target, ast.Name) and target.id == "os":
            found.append(node.lineno)
    return found


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def test_only_the_settings_module_reads_variables_by_name() -> None:
    readers = {str(path.relative_to(PACKAGE.parent)): lines for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "settings.py" and (lines := named_reads(path.read_text()))}
    assert readers == {}


def test_the_check_finds_each_way_of_reading_one() -> None:
    assert named_reads("import os\nos.environ.get('A')\nos.getenv('B')\nx = os.environ['C']\n") == [2, 3, 4]
    assert named_reads("import os\nf(os.environ)\nenv = dict(os.environ, A='1')\nos.environ['D'] = '1'\n") == []
