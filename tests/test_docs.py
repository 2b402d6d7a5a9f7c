"""The documentation: README.md stays a front page (at most 400 lines, the quick
start's two commands, every relative link resolving), the docs/ pages build with
`mkdocs build --strict` (a broken link or anchor, or a page left out of the nav,
fails), every `docs/<page>.md#anchor` that the code hands to users exists, and the
support matrix's footnotes and class list on docs/supported-models.md are what
scripts/support_matrix.py makes of the registry."""
import ast
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from doclinks import POINTER, ROOT, broken, relative_links

README = os.path.join(ROOT, "README.md")
# Where user-facing pointers live: error messages, docstrings, comments.
POINTER_TREES = ("python", "policies", "scripts", "examples", "benchmarks", "tests", "csrc")
# A pointer to a README section: what the pages replaced (README.md itself is a front page now).
README_SECTION = re.compile(r"README(?:\.md)?\s*(?:#[\w\-]|'[A-Z]|\"[A-Z]|:\s*'[A-Z])")


def test_readme_is_a_front_page():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    lines = text.count("\n")
    assert lines <= 400, f"README.md has {lines} lines (at most 400): move the detail to a page under docs/"
    # The quick start: the same two commands, each setting up what it needs.
    block = re.search(r"## Quick start\n.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md: no ## Quick start with a bash block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands


def test_readme_links_resolve():
    links = relative_links(README)
    assert any(file.startswith("docs/") for file, _ in links)
    assert not broken(links, README)


def test_every_page_is_linked_from_readme():
    """Each page under docs/ is one click from the front page (the nav is mkdocs.yml's)."""
    linked = {file for file, _ in relative_links(README)}
    pages = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))}
    assert len(pages) >= 10 and pages - linked == set(), sorted(pages - linked)


def test_pointers_to_the_docs_resolve():
    """`docs/<page>.md#anchor` in messages and docstrings names a page and a heading that exist,
    and nothing points at README sections any more."""
    bad, old = [], []
    for tree in POINTER_TREES:
        for path in glob.glob(os.path.join(ROOT, tree, "**", "*.*"), recursive=True):
            if not path.endswith((".py", ".sh", ".c", ".h")):
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
            pointers = [(os.path.join("docs", page), anchor) for page, anchor in POINTER.findall(text)]
            bad += broken(pointers, path)
            old += [f"{os.path.relpath(path, ROOT)}: {m.group(0)}" for m in README_SECTION.finditer(text)]
    assert not bad, bad
    assert not old, old


def test_mkdocs_build_strict(tmp_path):
    """The site builds with every link, anchor and nav entry valid, and every Python example
    on the front page and the pages is Python (it parses)."""
    for path in [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            for block in re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M):
                ast.parse(block, filename=os.path.relpath(path, ROOT))
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (requirements-dev.txt pins it): the site build is not checked")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                          os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "supported-models" / "index.html").exists()


def test_support_matrix_page_matches_the_registry():
    """The generated section of docs/supported-models.md: its legend, footnotes and
    class list are exactly what the generator writes for today's registry."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("_support_matrix", os.path.join(ROOT, "scripts", "support_matrix.py"))
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    families = matrix.registry()
    section = matrix.page_section()
    tail = matrix.notes_and_classes(families, matrix.footnotes(families))
    assert f"\n\n{tail}\n\n" in section or section.endswith(f"\n\n{tail}"), \
        "docs/supported-models.md: regenerate it with python scripts/support_matrix.py --write"
    assert section.startswith("| family | classes | " + " | ".join(matrix.FEATURES) + " |\n")
