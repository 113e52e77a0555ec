"""The built-in recipes: one copy, the repository's top-level recipes/ folder, shipped in the wheel.

pyproject.toml maps the data package ``stabkit.harness.recipes.builtin`` to ``recipes/``, so a wheel
holds them at ``stabkit/harness/recipes/builtin/*.toml``; a checkout or an editable install reads
``recipes/`` in place (`loader.pick_builtin_dir`). The last test (~20 s) builds a wheel, installs it into a
throwaway venv and runs them by name from another folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from stabkit.harness.recipes.spec.loader import (
    BUILTIN_PACKAGE,
    builtin_dir,
    builtin_recipes,
    find_recipe,
    pick_builtin_dir,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
DATA_PACKAGE = f"{BUILTIN_PACKAGE}.builtin"
REQUIRED = {"attention-logit-growth", "loss-spike", "nan-injection", "post-norm-no-warmup"}


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


# ---- fast: one copy, the package list, the resolution


def test_the_builtins_live_once_in_the_top_level_recipes_folder() -> None:
    assert builtin_dir().resolve() == (ROOT / "recipes").resolve()
    assert set(builtin_recipes()) >= REQUIRED
    assert not list((ROOT / "stabkit").rglob("*.toml")), "recipes live in recipes/, not in the package"


def test_pyproject_lists_every_package_and_maps_the_recipes() -> None:
    """Packages are listed (the data package has no folder under stabkit/): a new subpackage must be too."""
    config = setuptools_config()
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "stabkit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    listed = set(config["packages"])
    assert listed - {DATA_PACKAGE} == on_disk, (
        f"pyproject.toml [tool.setuptools] packages: add {sorted(on_disk - listed)}, "
        f"drop {sorted(listed - on_disk - {DATA_PACKAGE})}"
    )
    assert DATA_PACKAGE in listed
    assert config["package-dir"] == {DATA_PACKAGE: "recipes"}
    assert config["package-data"][DATA_PACKAGE] == ["*.toml"]


def test_the_wheel_copy_wins_then_a_checkout_then_nothing(tmp_path: Path) -> None:
    shipped = tmp_path / "site" / "stabkit" / "harness" / "recipes" / "builtin"
    checkout = tmp_path / "checkout"
    (checkout / "recipes").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    assert pick_builtin_dir(shipped, checkout) == checkout / "recipes"  # source checkout, editable install
    shipped.mkdir(parents=True)
    assert pick_builtin_dir(shipped, checkout) == shipped  # a wheel install
    shipped.rmdir()
    (checkout / "pyproject.toml").unlink()  # e.g. site-packages/recipes of some other distribution
    assert pick_builtin_dir(shipped, checkout) == shipped


def test_a_name_resolves_to_the_top_level_folder_from_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert find_recipe("loss-spike").resolve() == (ROOT / "recipes" / "loss-spike.toml").resolve()


# ---- a real wheel in a throwaway venv (~20 s: build, install, list, one 3-step run)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@pytest.mark.multiprocess
def test_a_wheel_install_lists_and_runs_the_recipes_by_name(tmp_path: Path) -> None:
    """Build a wheel from a copy of the sources (no network: the installed setuptools, no isolation),
    install it with --no-deps into a fresh venv that sees this environment's packages (torch, click)
    through a .pth file, then list and run recipes by name from an unrelated folder."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "stabkit", src / "stabkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "recipes", src / "recipes")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")
    }
    env["PIP_NO_INDEX"] = "1"
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            ".",
        ],
        src,
        env,
    )
    (wheel,) = dist.glob("stabkit-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.relative_to(src).as_posix()) for p in (src / "stabkit").rglob("__init__.py")}
    assert packages <= in_wheel, f"subpackages missing from the wheel: {sorted(packages - in_wheel)}"

    venv = tmp_path / "v"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], tmp_path, env)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, env
        ).strip()
    )
    (site / "_stabkit_test_parent.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch, click, pip
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stabkit = str(venv / ("Scripts/stabkit.exe" if os.name == "nt" else "bin/stabkit"))
    listed = _run([stabkit, "list", "recipes"], elsewhere, env)
    shipped = site / "stabkit" / "harness" / "recipes" / "builtin"
    for name in REQUIRED:
        assert f"{name}  ({shipped / name}.toml)" in listed, listed
    assert str(ROOT) not in listed

    where = _run(
        [
            str(python),
            "-c",
            "import stabkit; from stabkit.harness.recipes.spec.loader import find_recipe, load_recipe\n"
            "print(stabkit.__file__); print(find_recipe('loss-spike')); print(load_recipe('loss-spike').name)",
        ],
        elsewhere,
        env,
    ).split("\n")
    assert Path(where[0]).is_relative_to(site) and Path(where[1]) == shipped / "loss-spike.toml"
    assert where[2] == "loss-spike"

    out = _run(
        [stabkit, "run", "nan-injection", "--steps", "3", "--jobs", "1", "--out", str(elsewhere / "runs")],
        elsewhere,
        env,
        timeout=600,
    )
    assert (elsewhere / "runs" / "summary.json").is_file(), out
