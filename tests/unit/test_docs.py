"""The documentation: README.md stays an entry point, and the site under
docs/ builds with `mkdocs build --strict`, so a broken link, a missing
anchor or a page left out of the nav fails here rather than on a reader."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_README_LINES = 250
# [text](target), skipping images and absolute URLs
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _nav_pages(nav) -> list[str]:
    """Every page path named in mkdocs.yml's nav, however deeply nested."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_readme_is_an_entry_point():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in _LINK.findall(text) if "://" not in t]
    assert targets, "README.md links into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_page_is_in_the_nav():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    in_nav = set(_nav_pages(_mkdocs_config()["nav"]))
    assert pages - in_nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - in_nav)}"
    assert in_nav - pages == set(), f"nav entries without a page: {sorted(in_nav - pages)}"


def test_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("mkdocs and mkdocs-material are not installed: pip install -e '.[docs]' (make venv does)")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").exists()
