"""The README and the MkDocs pages in docs/: size, the quick start CI runs, links, the nav, no history.

Pure text checks (no network, no mkdocs needed); `mkdocs build --strict` in .ci/run checks the rendering.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT as ROOT
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
CI = ROOT / ".ci" / "run"
SRC = ROOT / "src"

README_MAX_BYTES = 12_500  # a README a user reads through; the manual lives in docs/
CI_MARKER = "# --- the README's test command, verbatim ---"
ISSUE_REF = re.compile(r"\bissues? #?\d+", re.IGNORECASE)  # history belongs in git, not in the product
# [text](target) and [text]: target; images too. Code spans are removed first (they may hold brackets).
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\S\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)


def _pages() -> list[Path]:
    return sorted(DOCS.glob("**/*.md"))


def _markdown_files() -> list[Path]:
    return [README, *_pages()]


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans (where `[x](y)` is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _links(text: str) -> list[str]:
    prose = _prose(text)
    return INLINE_LINK.findall(prose) + REF_LINK.findall(prose)


def _quick_start_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, "README.md has no `## Quick start` section"
    block = re.search(r"^```(?:bash|sh|console)?\n(.*?)^```", section.group(1), flags=re.M | re.S)
    assert block, "the README's quick start has no code block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _nav_pages() -> list[str]:
    """The .md files mkdocs.yml's `nav` names (read as text: no YAML parser needed)."""
    text = MKDOCS.read_text(encoding="utf-8")
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n?|\n)*)", text, flags=re.M)
    assert nav, "mkdocs.yml has no `nav:`"
    return re.findall(r"^\s*-\s*(?:[^\n]*?:\s*)?([\w./-]+\.md)\s*$", nav.group(1), flags=re.M)


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes, more than {README_MAX_BYTES:,}: move the detail into a page in docs/")


def test_quick_start_has_two_commands_and_ci_runs_the_second():
    commands = _quick_start_commands()
    assert len(commands) == 2, f"the quick start should hold exactly two commands, found {commands}"
    lines = CI.read_text(encoding="utf-8").splitlines()
    assert CI_MARKER in lines, f".ci/run has no line `{CI_MARKER}`"
    ci_command = lines[lines.index(CI_MARKER) + 1]
    assert commands[1] == ci_command, f"README: {commands[1]!r}\n.ci/run: {ci_command!r}"


def test_quick_start_first_command_runs_the_default_train():
    first = _quick_start_commands()[0]
    assert first.startswith("python3 -m venv .venv") and first.endswith(".venv/bin/memfit train"), first


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    bad = []
    for target in _links(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith(("#", "//")):
            continue  # a URL, a mail address, or an anchor on the same page
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not (path.parent / file_part).resolve().exists():
            bad.append(target)
    assert not bad, f"{path.relative_to(ROOT)} links to files that do not exist: {bad}"


def test_links_find_what_they_should():
    """The link reader itself: inline and reference links, not code."""
    text = "see [a](docs/a.md#x) and ![img](b.png)\n\n[ref]: c.md\n\n`[no](code.md)`\n```\n[no](fence.md)\n```\n"
    assert sorted(_links(text)) == ["b.png", "c.md", "docs/a.md#x"]


def test_every_page_is_in_the_nav():
    nav = _nav_pages()
    pages = [p.relative_to(DOCS).as_posix() for p in _pages()]
    assert pages, "docs/ has no pages"
    missing = [p for p in pages if p not in nav]
    absent = [p for p in nav if p not in pages]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
    assert not absent, f"mkdocs.yml's nav names pages that do not exist: {absent}"


def test_readme_links_to_every_verb_page():
    text = README.read_text(encoding="utf-8")
    for verb in ("estimate", "plan", "train", "diagnose", "replay", "serve"):
        assert f"docs/{verb}.md" in text, f"README.md does not link docs/{verb}.md"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_references(path):
    hits = [m.group(0) for m in ISSUE_REF.finditer(path.read_text(encoding="utf-8"))]
    assert not hits, f"{path.relative_to(ROOT)} refers to issues ({hits}): say what is, not which issue asked"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_source_files_exist(path):
    """Every `memfit/....py` file or `memfit/x/` folder the docs name is in src/ (the docs follow module moves)."""
    text = path.read_text(encoding="utf-8")
    names = set(re.findall(r"(?<![\w/.-])(memfit/[\w/]*\w(?:\.py|/))", text))
    missing = sorted(n for n in names if not (SRC / n).exists())
    assert not missing, f"{path.relative_to(ROOT)} names files that are not in src/: {missing}"


def _code_and_notes() -> list[Path]:
    """Every source, test and bench file and every README beside data: they say what is, like the docs."""
    roots = [SRC, ROOT / "tests", ROOT / "bench"]
    files = [f for r in roots for f in r.rglob("*") if f.suffix in {".py", ".md"} and f.is_file()]
    return sorted(f for f in files if f != Path(__file__).resolve())


def test_no_issue_references_in_code():
    hits = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in _code_and_notes()
            for m in ISSUE_REF.finditer(f.read_text(encoding="utf-8"))]
    assert not hits, f"code, tests and bench refer to issues: {hits[:20]}: say what the code is and why"


def test_issue_pattern():
    assert ISSUE_REF.search("fixed in issue 12") and ISSUE_REF.search("Issues #3") and ISSUE_REF.search("(issue 15)")
    assert not ISSUE_REF.search("no issue here") and not ISSUE_REF.search("issue-free")
