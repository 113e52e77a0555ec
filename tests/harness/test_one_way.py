"""The harness is a one-way dependency: the library never imports it (nor the CLI, nor the benchmark).

docs/architecture.md's layer table puts `cli` on top and `harness`/`bench` below it, above the whole library:
stabkit watches its own reference GPT like any model (the GPT *declares* its family, see
`stabkit.discovery.families`). A source scan with `ast`: every import statement in every file under
stabkit/ outside stabkit/harness/, stabkit/bench/ and stabkit/cli/ (absolute or relative, at module
level, inside functions or under TYPE_CHECKING), and `importlib.import_module` / `__import__` calls
with a literal module name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "stabkit"

TOP = ("harness", "bench", "cli")
"""Subpackages above the library: they may import it, it never imports them."""
ENTRY_POINTS = {"__main__.py"}
"""`python -m stabkit` runs the CLI: the one library-level file allowed to import it."""


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    """The dotted module name of `path` under the package folder `root`, and whether it is a package."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def absolute(module: str | None, level: int, here: str, is_package: bool) -> str:
    """The absolute name `from <level dots><module> import ...` means in module `here`."""
    if not level:
        return module or ""
    package = here.split(".") if is_package else here.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def imported(source: str, here: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every module a source may import."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module, node.level, here, is_package)
            yield node.lineno, base
            for alias in node.names:  # `from stabkit import harness` imports the subpackage
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func.split(".")[-1] not in ("import_module", "__import__") or not node.args:
                continue
            name = _literal(node.args[0])
            if name is None:
                continue  # a computed name (stabkit/__init__.py's lazy attributes): not a static import
            if name.startswith("."):
                anchor = _literal(node.args[1]) if len(node.args) > 1 else None
                if anchor is None:
                    continue
                level = len(name) - len(name.lstrip("."))
                name = absolute(name[level:] or None, level, anchor, True)
            yield node.lineno, name


def is_top(name: str, package: str = "stabkit") -> bool:
    return any(name == f"{package}.{t}" or name.startswith(f"{package}.{t}.") for t in TOP)


def violations(root: Path) -> list[str]:
    """'path:line imports module' for each import of a TOP subpackage from the library under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in TOP or str(rel) in ENTRY_POINTS:
            continue
        here, is_package = module_name(root, path)
        lines: dict[int, str] = {}
        for line, name in imported(path.read_text(encoding="utf-8"), here, is_package):
            if is_top(name, root.name):
                lines.setdefault(line, name)  # `from X import Y`: name X, not also X.Y
        out += [f"{root.name}/{rel}:{line} imports {name}" for line, name in lines.items()]
    return sorted(out)


def test_the_library_never_imports_the_harness_the_bench_or_the_cli() -> None:
    found = violations(PACKAGE)
    assert not found, (
        "the library must not import stabkit.harness / bench / cli (docs/architecture.md, Layers); declare what the "
        "library needs on the model's classes instead (stabkit.discovery.families.FAMILY_ATTR):\n"
        + "\n".join(found)
    )


PLANTED = {
    "discovery/families.py": """\
from __future__ import annotations
from torch import nn
from .roles import child                  # fine: stabkit.discovery.roles
from .harness import x                    # fine: stabkit.discovery.harness, not the harness
from ..harness_tools import y             # fine: another name
import stabkit.harnessed                  # fine

def family_of(block: nn.Module) -> str:
    from ..harness.models.gpt import Block   # line 9: relative, inside a function
    return "x"
""",
    "interventions/__init__.py": """\
from .. import harness                      # line 1: a package's own __init__, level 2
from . import harness as fine               # fine: stabkit.interventions.harness
""",
    "audit/spec.py": """\
import importlib
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from stabkit.harness.models import GPT   # line 4: under TYPE_CHECKING too
import stabkit.cli.app                       # line 5
def f():
    importlib.import_module("stabkit.bench.core")        # line 7
    importlib.import_module(".harness.recipes", "stabkit")  # line 8
    importlib.import_module(f".{f}", __name__)           # computed: not seen
""",
    "harness/models/gpt.py": "from ...discovery.families import STABKIT_GPT\nimport stabkit.harness.data\n",
    "cli/inspect_spec.py": "from ..harness.models import GPT\n",
    "bench/core.py": "from ..harness.models import GPT\n",
    "__main__.py": "from .cli import main\n",
}


def test_the_scan_finds_planted_imports(tmp_path: Path) -> None:
    root = tmp_path / "stabkit"
    for rel, source in PLANTED.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    assert violations(root) == [
        "stabkit/audit/spec.py:4 imports stabkit.harness.models",
        "stabkit/audit/spec.py:5 imports stabkit.cli.app",
        "stabkit/audit/spec.py:7 imports stabkit.bench.core",
        "stabkit/audit/spec.py:8 imports stabkit.harness.recipes",
        "stabkit/discovery/families.py:9 imports stabkit.harness.models.gpt",
        "stabkit/interventions/__init__.py:1 imports stabkit.harness",
    ]


@pytest.mark.parametrize(
    ("module", "level", "here", "is_package", "expected"),
    [
        ("harness.models", 2, "stabkit.discovery.families", False, "stabkit.harness.models"),
        (None, 2, "stabkit.interventions", True, "stabkit"),
        ("roles", 1, "stabkit.discovery.families", False, "stabkit.discovery.roles"),
        ("x", 1, "stabkit.discovery", True, "stabkit.discovery.x"),
        ("stabkit.harness", 0, "stabkit.monitor", False, "stabkit.harness"),
    ],
)
def test_relative_imports_resolve(
    module: str | None, level: int, here: str, is_package: bool, expected: str
) -> None:
    assert absolute(module, level, here, is_package) == expected
