"""The docs site and the README that points into it.

- `mkdocs build --strict` passes: with mkdocs.yml's `validation` settings a link to a missing page, a missing
  #anchor or image, a nav entry without its page and a page missing from the nav are all warnings, and
  --strict turns any warning into a failed build. About a second.
- docs/architecture.md really shows ARCHITECTURE.md (it includes it; the top-level file is the one source).
- The README stays a front page (at most 150 lines, the two set-up commands) and its links, which mkdocs does
  not see, resolve: files, and headings for #anchors.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.docs


def _slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading, for the headings these pages use."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", md.read_text(), flags=re.M | re.S)  # a `# comment` in code is no heading
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("mkdocs / mkdocs-material are not installed: pip install -e '.[dev]' (make test does)")
    out = tmp_path_factory.mktemp("site")
    # Not --quiet: mkdocs counts warnings for --strict only when they are logged. Run from elsewhere than the
    # repository, so that nothing in mkdocs.yml may depend on the working directory.
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=out, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    return out


def test_site_builds_strict(site):
    pages = sorted(p.relative_to(site).as_posix() for p in site.glob("*/index.html"))
    nav = re.findall(r"^  - [^:]+: (\S+)\.md$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert pages == sorted(f"{name}/index.html" for name in nav if name != "index")
    assert (site / "timeline_tiny_ppo.png").is_file()


def test_architecture_page_is_architecture_md(site):
    source = (REPO / "ARCHITECTURE.md").read_text()
    own = (REPO / "docs" / "architecture.md").read_text()  # the include, then measurements of the refactors
    html = (site / "architecture" / "index.html").read_text()
    assert "HybridFlow architecture" in html
    sections = len(re.findall(r"^## ", source, re.M))
    assert sections > 0 and html.count("<h2 ") == sections + len(re.findall(r"^## ", own, re.M))


def test_readme_is_a_short_front_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("md", ["README.md", "launch/README.md", "ARCHITECTURE.md"])
def test_links_outside_the_site_resolve(md):
    """Links in the markdown files mkdocs does not build: each relative target exists, each #anchor is a
    heading of its page."""
    source = REPO / md
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (source.parent / path).resolve() if path else source
        assert dest.exists(), f"{md}: link to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(dest), f"{md}: link to {target}, but {path or md} has no such heading"
