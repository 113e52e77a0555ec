"""One mechanism loads stabkit's public names lazily (`stabkit.lazy`), so that ``import stabkit`` and
the CLI's ``--help`` / ``list`` stay free of torch (tests/cli/test_fast.py checks that in fresh
processes): no package writes a ``__getattr__`` of its own."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

from stabkit.lazy import lazy, lazy_names

PACKAGE = Path(__file__).resolve().parents[2] / "stabkit"


def test_no_package_writes_its_own_module_getattr() -> None:
    own = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__"):
                own.append(f"{path.relative_to(PACKAGE.parent)}: def {node.name}")
    assert own == [p for p in own if p.startswith("stabkit/lazy.py")], own


def test_names_and_subpackages_load_once_and_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("lazy_demo")
    package.__path__ = []  # type: ignore[attr-defined]
    child = types.ModuleType("lazy_demo.child")
    child.VALUE = 42  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lazy_demo", package)
    monkeypatch.setitem(sys.modules, "lazy_demo.child", child)
    getattr_, dir_ = lazy("lazy_demo", {"VALUE": "child"}, submodules=("child",))
    package.__getattr__ = getattr_  # type: ignore[attr-defined]
    package.__all__ = ["VALUE"]  # type: ignore[attr-defined]
    assert package.VALUE == 42  # type: ignore[attr-defined]
    assert vars(package)["VALUE"] == 42  # kept: the next access is a plain attribute
    assert getattr_("child") is child
    assert {"VALUE", "child", "__all__"} <= set(dir_())
    with pytest.raises(AttributeError, match="module 'lazy_demo' has no attribute 'nope'"):
        getattr_("nope")
    with pytest.raises(AttributeError):
        lazy_names("lazy_demo", {})("VALUE")
