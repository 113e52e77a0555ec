"""The docs site (mkdocs.yml, docs/) builds with ``mkdocs build --strict`` — a broken link or anchor, a page
left out of the nav, an API name that no longer exists all fail — and every ```python block of
docs/**/*.md runs as written.

Conventions for a ```python block in docs/ (HTML comments: Markdown does not show them), on the lines
right before its fence (blank lines between are fine, any other text is not):

- ``<!-- no-run: why -->``: shown, not run here; say why (e.g. the test that runs it:
  tests/docs/test_readme_kernels.py runs its page's block, a block that needs a GPU or a network).
- ``<!-- setup: ... -->``: Python code (the comment's following lines) run first in the block's
  namespace and not shown: the ``model``, ``optimizer`` or ``loader`` a snippet takes as given.

Every block runs in a fresh namespace, in a temporary working folder (a ``logdir="runs/exp1"`` lands
there), with ``torch.set_num_threads(1)``, seed 0, and the plug-in registries (probes, detectors, actions,
interventions, attention kernels) restored afterwards, so a block that registers a plug-in leaves nothing
behind. tests/ is on sys.path (pyproject's pytest ``pythonpath``): ``from zoo import reference_gpt`` works
in a setup comment. A ``torch.library`` custom op cannot be defined twice in one process: a block that
defines one is run by its own test (module-scoped) and marked ``no-run`` here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first code line
    code: str
    setup: str
    skip: str | None  # the no-run reason, None = run

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.line}"


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[^\s`]*)")
NO_RUN = re.compile(r"^no-run\b:?\s*(?P<why>.*)$", re.S)
SETUP = re.compile(r"^setup:[ \t]*\n?(?P<code>.*)$", re.S)


def _dedent(lines: list[str], indent: str) -> str:
    return "".join(line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines)


def code_blocks(page: Path) -> list[Block]:
    """The ```python blocks of `page` with the directives of the HTML comments right before each."""
    lines = page.read_text().splitlines(keepends=True)
    blocks: list[Block] = []
    comments: list[str] = []  # the comments since the last text line
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if line.lstrip().startswith("<!--"):
            start = i
            while "-->" not in lines[i]:
                i += 1
                if i == len(lines):
                    raise AssertionError(f"{page}:{start + 1}: an HTML comment that never closes")
            text = "".join(lines[start : i + 1]).strip()
            comments.append(text[len("<!--") : text.rindex("-->")].strip())
        elif fence:
            indent, marker, lang = fence["indent"], fence["fence"], fence["lang"]
            start = i + 1
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                i += 1
            if i == len(lines):
                raise AssertionError(f"{page}:{start}: a code fence that never closes")
            if lang in ("python", "py", "python3"):
                skip, setup = None, []
                for comment in comments:
                    if m := NO_RUN.match(comment):
                        skip = m["why"].strip() or "marked no-run"
                    elif m := SETUP.match(comment):
                        setup.append(m["code"])
                blocks.append(Block(page, start + 1, _dedent(lines[start:i], indent), "\n".join(setup), skip))
            comments = []
        elif line.strip():
            comments = []  # a directive applies to the block right below it only
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in sorted(DOCS.rglob("*.md")) for b in code_blocks(page)]


BLOCKS = all_blocks()


def test_the_parser_reads_the_conventions(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n<!-- no-run: needs a GPU -->\n```python\nimport x\n```\n\n"
        "<!-- setup:\nn = 2\n-->\n\n```python\nassert n == 2\n```\n\n"
        "<!-- no-run -->\ntext between\n```python\nok = 1\n```\n"
        "```bash\necho no\n```\n"
        "- a list item:\n\n    ```python\n    y = 1\n    ```\n"
    )
    (gpu, setup, after_text, in_list) = code_blocks(page)
    assert (gpu.skip, gpu.code, gpu.line) == ("needs a GPU", "import x\n", 5)
    assert (setup.skip, setup.setup.strip(), setup.code) == (None, "n = 2", "assert n == 2\n")
    assert (after_text.skip, after_text.setup) == (None, "")  # the comment is not right before it
    assert in_list.code == "y = 1\n"


def test_the_docs_have_code_to_run() -> None:
    assert any(b.page == DOCS / "index.md" and b.skip is None for b in BLOCKS)


@pytest.fixture
def restored_registries() -> Iterator[None]:
    from stabkit.attention.kernels import KERNELS, forget_kernel
    from stabkit.plugins import ACTIONS, DETECTORS, INTERVENTIONS, PROBE_FAMILIES, PROBES

    registries = (PROBES, DETECTORS, ACTIONS, INTERVENTIONS)
    entries = [dict(r._entries) for r in registries]
    families, kernels = set(PROBE_FAMILIES), set(KERNELS)
    try:
        yield
    finally:
        for registry, saved in zip(registries, entries):
            registry._entries.clear()
            registry._entries.update(saved)
        PROBE_FAMILIES.clear()
        PROBE_FAMILIES.update(families)
        for name in set(KERNELS) - kernels:
            forget_kernel(name)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip is None], ids=lambda b: b.id)
def test_code_block_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restored_registries: None
) -> None:
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    try:
        if block.setup:
            exec(compile(block.setup, f"{block.page} (setup before line {block.line})", "exec"), namespace)
        # line numbers in a traceback are the page's: the code is compiled after line-1 blank lines
        exec(compile("\n" * (block.line - 1) + block.code, str(block.page), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)


def test_mkdocs_build_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What .ci/run's ``mkdocs build --strict`` does, in this process (a few seconds)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.chdir(ROOT)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
        try:
            build(config)
        except Abort as e:
            pytest.fail(f"mkdocs build --strict: {e}\n" + "\n".join(warnings))
    finally:
        logger.removeHandler(handler)
    assert not warnings
    site = tmp_path / "site"
    for page in ("index.html", "api/monitor/index.html", "api/interventions/index.html"):
        assert (site / page).is_file(), page
    monitor = (site / "api/monitor/index.html").read_text()
    assert 'id="stabkit.attach"' in monitor and 'id="stabkit.Monitor.step"' in monitor


@pytest.mark.parametrize(
    ("page", "complaint"),
    [
        ("See [the guide](guide/missing.md).", "guide/missing.md"),
        ("See [a heading](#no-such-heading).", "no-such-heading"),
        ("[stabkit.no_such_name][] is gone.", "stabkit.no_such_name"),
        ("::: stabkit.no_such_name", "stabkit.no_such_name"),
    ],
    ids=["link", "anchor", "cross-reference", "api-name"],
)
def test_the_strict_build_fails_on(page: str, complaint: str, tmp_path: Path) -> None:
    """The repo's mkdocs.yml, on a one-page site: each kind of rot the strict build is there to catch."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import MkDocsException

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\n{page}\n")
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        config = load_config(
            str(ROOT / "mkdocs.yml"),
            strict=True,
            docs_dir=str(docs),
            site_dir=str(tmp_path / "site"),
            nav=[{"Home": "index.md"}],
        )
        with pytest.raises(MkDocsException) as failed:  # Abort (warnings in strict mode) or a plugin's error
            build(config)
    finally:
        logger.removeHandler(handler)
    assert any(complaint in said for said in [str(failed.value), *warnings]), (failed.value, warnings)
