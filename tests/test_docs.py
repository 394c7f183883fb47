"""The manual (docs/, mkdocs.yml) builds under `mkdocs build --strict`, and a strict build fails
on a link to a missing page or to a missing anchor; the README stays a front page whose links
into docs/ all resolve."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 120

# [text](target) links in Markdown, not images; the target up to whitespace or ")"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = build(REPO / "mkdocs.yml", out)
    assert r.returncode == 0, f"mkdocs build --strict failed (exit {r.returncode}):\n{r.stderr}"
    return out


def test_the_manual_builds_strict(site):
    assert (site / "index.html").is_file()
    assert (site / "serving" / "index.html").is_file()


def copy_of_the_manual(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


def build_with_line(tmp_path: Path, page: str, line: str) -> subprocess.CompletedProcess:
    root = copy_of_the_manual(tmp_path)
    with open(root / "docs" / page, "a") as f:
        f.write(f"\n{line}\n")
    return build(root / "mkdocs.yml", tmp_path / "site")


def test_a_broken_link_fails_the_strict_build(tmp_path):
    r = build_with_line(tmp_path, "cli.md", "[x](no-such-page.md)")
    assert r.returncode != 0, r.stderr
    assert "no-such-page.md" in r.stderr, r.stderr


def test_a_broken_anchor_fails_the_strict_build(tmp_path):
    assert (REPO / "docs" / "serving.md").is_file()
    r = build_with_line(tmp_path, "cli.md", "[x](serving.md#no-such-anchor)")
    assert r.returncode != 0, r.stderr
    assert "no-such-anchor" in r.stderr, r.stderr


def test_the_readme_is_a_front_page_and_its_links_into_docs_resolve(site):
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    targets = [t for t in LINK.findall(readme) if t.startswith("docs/")]
    assert targets, "the README links into no page of the manual"
    for target in targets:
        path, _, anchor = target.partition("#")
        assert (REPO / path).is_file(), f"README.md links to {target}, which does not exist"
        if anchor:  # the anchor as the built page has it
            page = Path(path).relative_to("docs").with_suffix("")
            html = site / ("index.html" if page.name == "index" else page / "index.html")
            assert f'id="{anchor}"' in html.read_text(), f"README.md links to {target}: no such anchor"
