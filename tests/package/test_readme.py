"""README.md and the guides in docs/ run as written: every ```python block with ``>>>`` lines is a
doctest.

Each block runs on its own, in fresh globals (a reader pastes one block into a new session), from
a scratch folder with ``examples/`` importable, as the README says (run them from ``examples/``).
Expected outputs are compared as doctest does (long tables: ``...`` stands for elided rows).
"""
from __future__ import annotations

import doctest
import re

import pytest

from conftest import ROOT

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def page_blocks(page: str) -> list[tuple[int, str]]:
    text = (ROOT / page).read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text) if ">>>" in m.group(1)]


def readme_blocks() -> list[tuple[str, int, str]]:
    return [(page, line, block) for page in PAGES for line, block in page_blocks(page)]


def test_readme_has_examples():
    assert len(page_blocks("README.md")) >= 2 and len(readme_blocks()) >= 8
    assert (ROOT / "README.md").stat().st_size <= 25_000  # a first screen and a path; the reference is in docs/


def test_readme_links_to_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[\w.]+)\)", text)
    assert links and all((ROOT / link).exists() for link in links), links


@pytest.mark.parametrize("page,line,block", readme_blocks(), ids=[f"{p}:{n}" for p, n, _ in readme_blocks()])
def test_readme_block_runs_as_written(page, line, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    test = doctest.DocTestParser().get_doctest(block, {"__name__": "readme"}, f"{page}:{line}",
                                               str(ROOT / page), line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
    assert test.examples  # really ran something
    for name in ("gat.svg", "gat_timeline.png"):
        if name in block:
            assert (tmp_path / name).stat().st_size > 2000
