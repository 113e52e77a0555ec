"""The CLI answers at once: `--help`, `<command> --help` and `list recipes|presets|advice` import
neither torch nor scipy (checked in fresh subprocesses, never by timing), and `import stabkit` stays
light while every public name still resolves."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from stabkit.cli import main

HEAVY = ("torch", "scipy")
COMMANDS = ("bench", "demo", "inspect", "list", "report", "run", "sweep")


def imported_modules(args: list[str]) -> set[str]:
    """Top-level modules `python -X importtime -m stabkit ARGS` imported (from its import log)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "stabkit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name.split(".")[0])
    assert "stabkit" in names, "the import log was not read"
    return names


def run_python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.multiprocess
def test_help_imports_neither_torch_nor_scipy() -> None:
    heavy = imported_modules(["--help"]) & set(HEAVY)
    assert not heavy, f"`stabkit --help` imported {sorted(heavy)}"


@pytest.mark.multiprocess
def test_light_commands_import_neither_torch_nor_scipy() -> None:
    """Each command's --help and `list recipes|presets|advice`, each in a fresh interpreter."""
    cases = [[c, "--help"] for c in COMMANDS] + [
        ["list", s] for s in ("recipes", "presets", "advice", "plugins")
    ]
    out = run_python(
        f"""
        import json, subprocess, sys
        code = (
            "import sys\\n"
            "from stabkit.cli import main\\n"
            "sys.argv = ['stabkit', *sys.argv[1:]]\\n"
            "try:\\n    main()\\nexcept SystemExit as exc:\\n    assert not exc.code, exc.code\\n"
            "print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\\n"
        )
        found = {{}}
        for case in {cases!r}:
            proc = subprocess.run([sys.executable, "-c", code, *case], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr
            found[" ".join(case)] = proc.stderr.rsplit("HEAVY", 1)[1].strip()
        print(json.dumps(found))
        """
    )
    found = json.loads(out)
    assert len(found) == len(cases)
    assert all(v == "[]" for v in found.values()), {k: v for k, v in found.items() if v != "[]"}


@pytest.mark.multiprocess
def test_import_stabkit_is_light_and_names_resolve_lazily() -> None:
    out = run_python(
        """
        import sys
        import stabkit
        print(sorted(m for m in ("torch", "scipy", "numpy") if m in sys.modules))
        assert callable(stabkit.attach) and callable(stabkit.inspect_model) and callable(stabkit.z_loss)
        from stabkit import Monitor, MonitorConfig, DetectConfig, InstabilityError, ModelMap, DiscoveryError
        print("scipy" in sys.modules)
        """
    )
    before, scipy_after = out.split("\n")[:2]
    assert before == "[]"
    assert scipy_after == "False", "scipy.stats loads on the first drift fit, not with the library"


@pytest.mark.multiprocess
def test_stabkit_audit_is_the_function_whatever_was_imported_first() -> None:
    out = run_python(
        """
        import stabkit.audit.findings      # the subpackage first
        import stabkit
        from stabkit.audit import Report, RULES
        from stabkit.audit.core import audit
        assert stabkit.audit is audit, stabkit.audit
        assert callable(stabkit.audit)
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_public_names_and_subpackages_resolve() -> None:
    import stabkit

    for name in stabkit.__all__:
        assert getattr(stabkit, name) is not None, name
    assert stabkit.attach is importlib.import_module("stabkit.attaching").attach
    assert stabkit.Monitor is importlib.import_module("stabkit.monitor").Monitor
    assert stabkit.audit is importlib.import_module("stabkit.audit.core").audit
    assert stabkit.interventions.apply is importlib.import_module("stabkit.interventions.registry").apply
    assert "attach" in dir(stabkit) and "interventions" in dir(stabkit)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = stabkit.nope  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "package",
    [
        "stabkit.audit",
        "stabkit.bench",
        "stabkit.distributed",
        "stabkit.integrations",
        "stabkit.harness.models",
        "stabkit.harness.recipes",
    ],
)
def test_lazy_packages_export_every_name(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError):
        module.__getattr__("no_such_name")


def test_cli_copies_of_names_match_the_library() -> None:
    from stabkit.bench import VARIANTS
    from stabkit.bench.presets import bench_sizes
    from stabkit.cli.bench_cmd import SIZES, VARIANT_NAMES

    assert VARIANT_NAMES == VARIANTS
    assert bench_sizes() == SIZES


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"bias": True},
        {"qk_norm": True},
        {"qk_norm": True, "bias": True, "norm_placement": "sandwich"},
        {"mlp": "swiglu", "norm": "rmsnorm"},
        {"mlp": "swiglu", "bias": True},
        {"n_kv_heads": 1, "positions": "rope", "tie_embeddings": True},
        {"norm": "rmsnorm", "qk_norm": True, "norm_placement": "post", "d_ff": 100},
    ],
)
def test_non_embedding_params_counts_like_the_model(overrides: dict[str, object]) -> None:
    from stabkit.cli.list_cmd import non_embedding_params
    from stabkit.harness.models import GPT, PRESETS, preset_config

    for name in PRESETS:
        cfg = preset_config(name, **overrides)
        with torch.device("meta"):
            model = GPT(cfg)
        assert non_embedding_params(cfg) == model.num_parameters(), (name, overrides)


def test_list_sections_print() -> None:
    result = CliRunner().invoke(main, ["list"], standalone_mode=False)
    assert result.exit_code == 0, result.output
    for section in ("interventions", "recipes", "presets", "advice", "plugins"):
        assert f"== {section} ==" in result.output
    assert "attn_entropy   stabkit.detectors.entropy:EntropyCollapseDetector" in result.output
    assert "qk_norm" in result.output and "attention-logit-growth" in result.output
    assert "tiny" in result.output and "0.10 M" in result.output  # tiny: ~100 k non-embedding parameters


def test_inspect_builds_small_presets_on_the_cpu() -> None:
    from stabkit.cli.inspect_spec import inspect_device

    assert inspect_device("tiny") == inspect_device("small") == "cpu"
    assert inspect_device("1b") == inspect_device("hf:llama") == "meta"
    result = CliRunner().invoke(main, ["inspect", "tiny", "--audit"], standalone_mode=False)
    assert result.exit_code == 0, result.output
    assert "(GPT, cpu device)" in result.output and "output head:" in result.output
