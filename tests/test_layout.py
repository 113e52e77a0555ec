"""The test tree mirrors the package, and the tests that start processes say so.

- Every test file sits in a folder named after a stabkit subpackage (tests/detectors for
  stabkit/detectors, tests/harness/recipes for stabkit/harness/recipes, which is stabkit/recipes until
  the harness move) or in one of the cross-cutting folders in `CROSS_CUTTING`; only this file sits at
  the root. Every test folder has an __init__.py, so same-named files in two folders do not clash.
- Every test that starts a process (subprocess, multiprocessing, torchrun, which runs through
  subprocess) carries the `multiprocess` marker. A source scan of each test module, following calls
  to the module's own helpers and fixtures; processes started inside stabkit (the `stabkit run`
  worker pool, bench's memory subprocesses) are not seen, so mark those by hand.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "stabkit"

CROSS_CUTTING = {
    "monitor": "the Monitor as a whole and its wiring (stabkit/monitor.py, lifecycle.py, hooks.py, plugins.py)",
    "docs": "the docs site builds and its examples run as written",
    "reliability": "real training scripts, crashes, signals, full disks, odd inputs",
    "standins": "pure-PyTorch stand-ins for GPU attention libraries and the float64 reference",
    "device": "the standing GPU checks (run_checks.sh on a lent CUDA device), each with its CPU twin",
}
HELPER_FOLDERS = {"dist_workers", "zoo_models", "__pycache__"}  # no tests inside: run or imported by tests

SPAWN = re.compile(
    r"^(subprocess\.(run|Popen|call|check_call|check_output|getoutput|getstatusoutput)"
    r"|os\.(system|popen|fork|forkpty|spawn\w*|exec\w*|posix_spawn\w*)"
    r"|(torch\.)?multiprocessing\.\w+|concurrent\.futures\.ProcessPoolExecutor)$"
)


def all_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if not HELPER_FOLDERS & set(p.relative_to(TESTS).parts))


def is_package(path: Path) -> bool:
    return (path / "__init__.py").is_file()


def mirrors_a_subpackage(parts: tuple[str, ...]) -> bool:
    if parts[0] in CROSS_CUTTING:
        return len(parts) == 1
    if is_package(PACKAGE.joinpath(*parts)):
        return True
    # stabkit.models, .data, .training and .recipes before they move under stabkit.harness
    return parts[0] == "harness" and len(parts) > 1 and is_package(PACKAGE.joinpath(*parts[1:]))


def test_test_files_mirror_the_package() -> None:
    wrong = []
    for path in all_test_files():
        folder = path.parent.relative_to(TESTS).parts
        if not folder:
            if path.name != "test_layout.py":
                wrong.append(f"{path.name}: at the tests/ root; move it to tests/<subpackage>/")
            continue
        if not mirrors_a_subpackage(folder):
            wrong.append(
                f"{path.relative_to(TESTS)}: stabkit/{'/'.join(folder)} is not a subpackage "
                f"(nor stabkit/{'/'.join(folder[1:]) or '?'} for harness/), nor one of {sorted(CROSS_CUTTING)}"
            )
        for depth in range(len(folder) + 1):
            if not is_package(TESTS.joinpath(*folder[:depth])):
                wrong.append(f"tests/{'/'.join(folder[:depth])}: no __init__.py")
    assert not wrong, "\n".join(sorted(set(wrong)))


def qualified_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted name, from the module's imports (`import subprocess as sp`, `from os import fork`)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def starts_a_process(call: ast.Call, names: dict[str, str]) -> bool:
    func = ast.unparse(call.func)
    head, _, rest = func.partition(".")
    qualified = names.get(head, head) + (f".{rest}" if rest else "")
    return bool(SPAWN.match(qualified))


def marked(decorators: list[ast.expr], marker: str) -> bool:
    return any(re.search(rf"\bmark\.{marker}\b", ast.unparse(d)) for d in decorators)


def unmarked_spawning_tests(source: str) -> list[str]:
    tree = ast.parse(source)
    names = qualified_names(tree)
    functions = {
        node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    used = {
        name: {n.id for n in ast.walk(f) if isinstance(n, ast.Name)} | {a.arg for a in f.args.args}
        for name, f in functions.items()
    }  # helpers called and fixtures requested
    spawning = {
        name
        for name, f in functions.items()
        if any(isinstance(n, ast.Call) and starts_a_process(n, names) for n in ast.walk(f))
    }
    grown = True
    while grown:
        more = {name for name in functions if name not in spawning and used[name] & spawning}
        spawning |= more
        grown = bool(more)
    module_marks = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in node.targets)
    ]
    if marked(module_marks, "multiprocess"):
        return []
    return sorted(
        name
        for name in spawning
        if name.startswith("test") and not marked(functions[name].decorator_list, "multiprocess")
    )


def test_tests_that_start_processes_are_marked_multiprocess() -> None:
    unmarked = [
        f"{path.relative_to(TESTS)}::{name}"
        for path in all_test_files()
        for name in unmarked_spawning_tests(path.read_text())
    ]
    assert not unmarked, "add @pytest.mark.multiprocess (or a module pytestmark) to:\n" + "\n".join(unmarked)


def test_the_scan_sees_helpers_fixtures_and_module_marks() -> None:
    source = """
import pytest
import subprocess as sp
from multiprocessing import Process

def helper():
    return sp.run(["true"])

@pytest.fixture
def server():
    Process(target=print).start()

def test_direct():
    sp.Popen(["true"])

def test_through_helper():
    helper()

def test_through_fixture(server):
    pass

@pytest.mark.multiprocess
def test_marked():
    helper()

def test_in_process():
    print("torchrun")
"""
    assert unmarked_spawning_tests(source) == ["test_direct", "test_through_fixture", "test_through_helper"]
    assert unmarked_spawning_tests("import pytest\npytestmark = [pytest.mark.multiprocess]\n" + source) == []
