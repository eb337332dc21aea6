"""Every relative Markdown link in README.md and docs/**/*.md points at a file or folder that exists.

http(s)/mailto links and anchor-only links (`#section`) are not checked; an `#anchor` after a path is
stripped before the path is resolved against the linking file's folder. Links inside fenced code
blocks and inline code spans are not links.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target) and ![alt](target), target optionally in <...>, optionally followed by a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]+(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target reference definitions
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
SKIP = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|#|//)")   # a scheme (http:, mailto:, ...), an anchor, a host


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
    return files + sorted((ROOT / "docs").rglob("*.md"))


def relative_links(text: str) -> list[str]:
    text = FENCE.sub("", text)
    text = CODE_SPAN.sub("", text)
    targets = [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in REF_DEF.finditer(text)]
    out = []
    for target in targets:
        target = target.strip("<>").strip()
        if not target or SKIP.match(target):
            continue
        out.append(target)
    return out


def dangling(path: Path) -> list[str]:
    bad = []
    for target in relative_links(path.read_text(encoding="utf-8")):
        rel = target.split("#", 1)[0].split("?", 1)[0]
        if not rel:
            continue
        resolved = (ROOT / rel.lstrip("/")) if rel.startswith("/") else (path.parent / rel)
        if not resolved.exists():
            bad.append(target)
    return bad


def test_the_link_parser_finds_links_and_skips_what_is_not_a_relative_link():
    text = ("See [a](a.md), [b](sub/b.md#part), ![img](p.png \"title\"), [c](<with space.md>),\n"
            "[web](https://example.com/x.md), [anchor](#here), `[code](not-a-link.md)`,\n"
            "```\n[fenced](nope.md)\n```\n[ref]: ref.md\n[n [nested]](n.md)\n")
    assert relative_links(text) == ["a.md", "sub/b.md#part", "p.png", "with space.md", "n.md", "ref.md"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path):
    assert dangling(path) == [], f"{path.relative_to(ROOT)} links to missing files or folders"
