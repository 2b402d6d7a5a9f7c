"""Links into the documentation, as the tests check them: the relative links of a
Markdown file, the anchors its headings get, and the `docs/<page>.md#anchor`
pointers that error messages and docstrings hand to users.

An anchor is the heading's text as MkDocs' table of contents (Python-Markdown's
`toc` extension, default slugify) and GitHub both make it: markup and every
character other than letters, digits, `_`, `-` and spaces dropped, lower-cased,
runs of spaces and hyphens turned into one `-`."""
from __future__ import annotations

import os
import re
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `docs/<page>.md` or `docs/<page>.md#anchor`, as error messages and docstrings cite a page
POINTER = re.compile(r"\bdocs/([\w\-]+\.md)(?:#([\w\-]+))?")
# [text](target) and ![alt](target); a target with a scheme (https:, mailto:) is not relative
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _outside_code(text: str):
    """The lines of a Markdown text that are not inside a fenced code block."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def anchors(path: str) -> set[str]:
    """The anchors of every heading of the Markdown file at `path`."""
    with open(path, encoding="utf-8") as f:
        return {slug(line.lstrip("#")) for line in _outside_code(f.read()) if re.match(r"#{1,6} ", line)}


def relative_links(path: str) -> list[tuple[str, str]]:
    """(file, anchor) of every relative link in the Markdown file at `path`, the file
    relative to the repository root ("" for an anchor in the same file); inline code
    spans are not links."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    base = os.path.relpath(os.path.dirname(os.path.abspath(path)), ROOT)
    out = []
    for line in _outside_code(text):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.\-]*:", target):
                continue
            file, _, anchor = target.partition("#")
            out.append((os.path.normpath(os.path.join(base, file)) if file else "", anchor))
    return out


def broken(links: list[tuple[str, str]], source: str) -> list[str]:
    """The links (from `relative_links`, or pointers with the file relative to the
    root) whose file or anchor does not exist, as 'source -> file#anchor'."""
    bad = []
    for file, anchor in links:
        path = os.path.join(ROOT, file or os.path.relpath(source, ROOT))
        if not os.path.exists(path):
            bad.append(f"{os.path.relpath(source, ROOT)} -> {file}")
        elif anchor and (not path.endswith(".md") or anchor not in anchors(path)):
            bad.append(f"{os.path.relpath(source, ROOT)} -> {file}#{anchor}")
    return bad
