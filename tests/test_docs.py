"""The examples of README.md and docs/*.md run, and say what they show.

Each page's ```python blocks run in order in one namespace that starts with ``spark`` (the
suite's session) and the repository as the working directory. A ```text block right after a
python block is that block's printed output: the run must print it (``...`` matches any text,
as doctest's ELLIPSIS; trailing spaces and blank lines at either end are ignored). Shell and
YAML blocks are not run. A page may change Spark settings: they are restored after it.
"""
from __future__ import annotations

import contextlib
import doctest
import inspect
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass
class Block:
    language: str
    line: int       # 1-based line of the block's first line of code
    text: str
    end: int        # 1-based line of the closing fence


def blocks(page: Path) -> list[Block]:
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page.name}:{i + 1}: a code block is never closed"
        found.append(Block(opening.group(1), i + 2, "\n".join(lines[i + 1:end]) + "\n", end + 1))
        i = end + 1
    return found


def examples(page: Path) -> list[tuple[Block, str | None]]:
    """The page's python blocks, each with the output its following text block shows (or None)."""
    lines = page.read_text().splitlines()
    found = blocks(page)
    pairs = []
    for block, after in zip(found, found[1:] + [None]):
        if block.language != "python":
            continue
        shown = None
        if (after is not None and after.language == "text"
                and not any(line.strip() for line in lines[block.end:after.line - 2])):
            shown = after.text
        pairs.append((block, shown))
    return pairs


def _normalised(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"


def _page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.fixture
def restored_settings(spark):
    """Spark settings as they were before the page: a page may set spark.nearestJoin.* to show
    what they do, and the session is the whole suite's."""
    before = dict(spark.conf.getAll)
    yield
    after = dict(spark.conf.getAll)
    for key in after.keys() - before.keys():
        spark.conf.unset(key)
    for key, value in before.items():
        if after.get(key) != value:
            spark.conf.set(key, value)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_examples_run_and_print_what_the_page_shows(page, spark, restored_settings, monkeypatch):
    monkeypatch.chdir(REPO)
    # The pages show what a new user's session does: the suite's turns the local plan off
    # (tests/conftest.py); restored_settings turns it off again after the page.
    spark.conf.unset("spark.nearestJoin.localLimitBytes")
    found = examples(page)
    assert found, f"{_page_id(page)} has no ```python example"
    namespace = {"spark": spark, "__name__": "__docs__"}
    checker = doctest.OutputChecker()
    for block, shown in found:
        # Padded so that a traceback names the page's own line numbers.
        code = compile("\n" * (block.line - 1) + block.text, str(page), "exec")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code, namespace)
        if shown is None:
            continue
        want, got = _normalised(shown), _normalised(printed.getvalue())
        assert checker.check_output(want, got, doctest.ELLIPSIS), (
            f"{_page_id(page)}:{block.line}: the example printed\n{got}\nwhere the page shows\n{want}")


def test_the_signature_shown_is_nearest_by_joins():
    from nearest_join import nearest_by_join

    bare = inspect.signature(nearest_by_join).replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in
                    inspect.signature(nearest_by_join).parameters.values()],
        return_annotation=inspect.Signature.empty)
    expected = "nearest_by_join" + str(bare).replace("'", '"')
    shown = [block.text for page in PAGES for block in blocks(page)
             if block.language == "text" and block.text.startswith("nearest_by_join(")]
    assert shown, "no page shows nearest_by_join's signature"
    for text in shown:
        assert " ".join(text.split()).replace("( ", "(") == expected


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_name_files_that_exist(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    missing = [target for target in LINK.findall(text)
               if not re.match(r"[a-z]+:", target) and not target.startswith("#")
               and not (page.parent / target.split("#")[0]).exists()]
    assert not missing, f"{_page_id(page)} links to files that do not exist: {missing}"
