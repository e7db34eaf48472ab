"""docs/architecture.md names the modules of the request's path: each one exists, so the page a new
maintainer reads first cannot drift from the tree without this test failing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_the_architecture_page_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:gateway|lua)/[\w/]+(?:\.py|\.lua|/))", text))
    assert len(named) > 30
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, missing


def test_the_decision_step_is_the_one_every_door_uses() -> None:
    """The page's central claim: the pipeline and the RLS service reach the limiter through
    gateway/decision.py alone."""
    for module in ("gateway/pipeline.py", "gateway/rls/service.py"):
        text = (ROOT / module).read_text()
        assert "from gateway.decision import" in text, module
        assert "limiter.decide" not in text and "refusals.decide" not in text, module
