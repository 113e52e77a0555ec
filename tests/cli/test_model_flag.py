"""`--model SPEC` / `--model-option KEY=VALUE` on the commands that build a model (run, sweep, lead-time,
inspect, bench): bad specs exit 2 with one line, a recipe that cannot apply says so and exits 0, and a
run trains the model named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from stabkit.cli import main
from stabkit.sinks import LOG_NAME, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
ENCODER = ROOT / "docs" / "examples" / "encoder_lm.py"


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "attention-logit-growth", "--model", "gpt3"], "unknown model spec 'gpt3'"),
        (["run", "attention-logit-growth", "--model", "hf:nope"], "hf:nope is not known"),
        (["run", "attention-logit-growth", "--model-option", "a=1"], "--model-option needs --model"),
        (["run", "attention-logit-growth", "--model", "hf:llama", "--model-option", "oops"], "key=value"),
        (
            ["run", "attention-logit-growth", "--model", "hf:mixtral", "--model-option", "nope=1"],
            "not a field of MixtralConfig",
        ),
        (
            ["run", "attention-logit-growth", "--model", "tiny", "--size", "small"],
            "--model tiny and --size small disagree",
        ),
        (
            ["run", "attention-logit-growth", "--model", "no_such_pkg_xyz:build"],
            "cannot import 'no_such_pkg_xyz'",
        ),
        (["sweep", "lr-sensitivity", "--model", "hf:nope"], "hf:nope is not known"),
        (["lead-time", "attention-logit-growth", "--model", "gpt3"], "unknown model spec"),
        (["inspect", "hf:nope"], "hf:nope is not known"),
        (["bench", "--model", "hf:", "--quick"], "hf: needs a model_type"),
    ],
)
def test_bad_model_specs_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.output, lines


def test_a_recipe_whose_trigger_cannot_apply_is_skipped_with_the_reason(tmp_path: Path) -> None:
    result = invoke("run", "post-norm-no-warmup", "--model", "hf:llama", "--out", str(tmp_path / "o"))
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines() == [
        "skipped: post-norm-no-warmup needs a post-norm model (its trigger); hf:llama is pre-norm: skipped"
    ]
    assert not (tmp_path / "o" / "summary.json").exists()  # nothing trained


def test_run_trains_a_hugging_face_model_at_the_recipes_size(tmp_path: Path) -> None:
    out = tmp_path / "llama"
    result = invoke(
        "run", "low-precision", "--model", "hf:llama", "--steps", "4", "--jobs", "1", "--out", str(out)
    )
    assert result.exit_code in (0, 1), result.output  # verdicts on 4 steps do not matter here
    head = result.output.splitlines()[0]
    assert head.startswith("low-precision [hf:llama at tiny, cpu, seed 0, 4 steps")
    assert "skipped fp32_softmax: changes softmax_fp32 of the reference GPT" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"]["spec"] == "hf:llama" and "fp32_softmax" in summary["arch"]["skipped"]
    assert "fp32_softmax" not in summary["variants"]
    base = summary["variants"]["baseline"]
    assert base["status"] == "done"
    # an untrained Llama (weights N(0, 0.02)) predicts ~uniformly over the 256 bytes: loss ~ ln 256
    assert abs(base["initial_loss"] - math.log(256)) < 0.05, base["initial_loss"]
    # its attention is measured where discovery found it (the TokensToLogits wrapper adds "model.")
    names = {
        k for r in read_jsonl(out / "baseline" / LOG_NAME) if r["type"] == "metrics" for k in r["values"]
    }
    assert "attn/model.model.layers.0.self_attn/max_logit" in names, sorted(names)[:20]
    assert math.isfinite(base["max_attn_logit"]) and base["max_attn_logit"] > 0


def test_run_trains_a_users_factory_and_inspect_and_bench_take_it(tmp_path: Path) -> None:
    spec = f"{ENCODER}:build"
    out = tmp_path / "enc"
    result = invoke(
        "run", "attention-logit-growth", "--model", spec, "--steps", "4", "--jobs", "1", "--out", str(out)
    )
    assert result.exit_code in (0, 1), result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"]["kind"] == "callable" and summary["variants"]["qk_norm"]["status"] == "done"
    assert abs(summary["variants"]["baseline"]["initial_loss"] - math.log(256)) < 0.5
    shown = invoke("inspect", spec, "--audit")
    assert shown.exit_code == 0 and "family: torch-encoder" in shown.output, shown.output
    bench = invoke(
        "bench", "--model", spec, "--size", "tiny", "--quick", "--variants", "default", "--no-memory"
    )
    assert bench.exit_code == 0, bench.output
    assert f"model={spec}" in bench.output and "size=tiny" in bench.output
