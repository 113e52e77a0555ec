"""Full-length tiny recipes: the issue's Done-when numbers (minutes each, on 2 CPU cores).

Marked `slow` (deselected by default; run with ``-m slow``): the default suite tests the same
machinery on shortened runs (harness/recipes/run/test_run.py, cli/test_run.py). The tests check what
was trained (every variant, every step), not how long it took: the wall time of each run is printed
(and written to the summary, ``seconds``); step time is measured by `stabkit bench`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from cli_process import StabkitCLI

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def stabkit(cli: StabkitCLI, *args: str) -> tuple[dict[str, Any], str]:
    """``stabkit ARGS`` (a run or a sweep, ``--out`` given): its summary and stdout. Checks that it
    exited 0 and trained every variant (at every LR) for all of the recipe's steps."""
    proc = cli.run(*args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(args[args.index("--out") + 1])
    name = "sweep.json" if args[0] == "sweep" else "summary.json"
    summary = json.loads((out / name).read_text())
    print(proc.stdout, f"\n{summary['seconds']:.0f} s")
    assert summary["complete"] is True and summary["interrupted"] is False
    runs = (
        [r for v in summary["variants"].values() for r in v["runs"].values()]
        if args[0] == "sweep"
        else list(summary["variants"].values())
    )
    assert runs and all(r["status"] == "done" for r in runs), [r["status"] for r in runs]
    if args[0] == "run":
        assert all(r["steps_done"] == r["steps"] for r in runs), [(r["steps_done"], r["steps"]) for r in runs]
    return summary, proc.stdout


def verdicts(summary: dict[str, Any]) -> dict[str, str]:
    return {n: v["verdict"] for n, v in summary["verdicts"].items()}


def test_attention_logit_growth(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, text = stabkit(
        stabkit_cli, "run", "attention-logit-growth", "--jobs", "2", "--out", str(tmp_path / "o")
    )
    base, qk = s["variants"]["baseline"], s["variants"]["qk_norm"]
    assert base["max_attn_logit"] > 1e3 and base["val_loss"] > s["variants"]["reference"]["val_loss"] + 0.25
    assert qk["max_attn_logit"] < 100
    assert verdicts(s)["baseline"] == "reproduced" and verdicts(s)["qk_norm"] == "fixed"
    # QK-Clip at 30 under AdamW at LR 0.1 (measured, seed 0: val 2.371, 0.236 above the reference:
    # not fixed; a clipped head's max reaches ~58 before the next clip); the verdict follows the numbers
    clip = s["variants"]["qk_clip"]
    assert clip["qk_clip_heads_fraction"] > 0 and clip["qk_clip_steps"] > 0
    assert clip["val_loss"] < base["val_loss"] - 0.1
    ok = clip["val_loss"] - s["variants"]["reference"]["val_loss"] < 0.2
    held = clip["qk_clip_max_after_clip"] <= 45.0  # its mechanism check: "fixed*" when only it fails
    assert verdicts(s)["qk_clip"] == (("fixed" if held else "fixed*") if ok else "not fixed")
    # the rescues (measured, seeds 0/1/2: entropy collapse at step 25, back to step 0 (25 steps lost),
    # the fix on, the LR re-warmed over 15 steps: qk_clip 2.346/2.331/2.392 vs 2.371/2.350/2.347 from
    # the start (-0.024/-0.019/+0.045), qk_norm 2.285/2.284/2.320 vs 2.269/2.220/2.296
    # (+0.016/+0.064/+0.024): rescued 3/3 each); the verdicts must follow from the numbers either way
    for name, fix in (("rescue", "qk_clip"), ("rescue_qk_norm", "qk_norm")):
        rescue = s["variants"][name]
        assert rescue["rescue_count"] >= 1 and rescue["rescue_fixes"][0] == fix
        assert 0 < rescue["steps_lost"] <= rescue["rescue_step"]
        diff = rescue["val_loss"] - s["variants"][fix]["val_loss"]
        assert verdicts(s)[name] == ("rescued" if diff <= 0.1 else "not rescued")
        assert rescue["val_loss"] < base["val_loss"]  # better than doing nothing
        assert f"{name}: {verdicts(s)[name]}" in text and "rescue at step" in text
    assert "re-warmed" in " ".join(e["message"] for e in s["variants"]["rescue"]["event_list"])


def test_lr_sensitivity_sweep(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, _ = stabkit(stabkit_cli, "sweep", "lr-sensitivity", "--jobs", "2", "--out", str(tmp_path / "o"))
    base, fix = s["variants"]["baseline"], s["variants"]["qk_norm_z_loss"]
    assert base["lr_sensitivity_high"] >= 2 * fix["lr_sensitivity_high"]
    assert verdicts(s) == {"baseline": "reproduced", "qk_norm_z_loss": "fixed"}


def test_output_logit_divergence(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, _ = stabkit(stabkit_cli, "run", "output-logit-divergence", "--jobs", "2", "--out", str(tmp_path / "o"))
    v = s["variants"]
    base, z, ref = v["baseline"], v["z_loss"], v["reference"]
    # the drift is there (Adam on the never-seen bytes' head rows), at the safe LR too
    assert base["mean_logit"] < -8.0 and ref["mean_logit"] < -5.0
    assert z["mean_abs_logz"] <= base["mean_abs_logz"] - 0.2  # z-loss's mechanism
    # the verdict follows from the numbers; measured at this size: not reproduced (the baseline's
    # mean logit is within ~2 of the reference's, log Z stays 5-8, z-loss does not recover the loss)
    reproduced = (
        base["mean_logit"] < -8.0
        and base["mean_logit"] - ref["mean_logit"] < -10.0
        and base["val_loss"] - ref["val_loss"] > 0.25
    )
    assert verdicts(s)["baseline"] == ("reproduced" if reproduced else "not reproduced")
    if not reproduced:
        assert verdicts(s)["z_loss"] == "not reproduced at this size"
    assert 4.0 < base["mean_logz"] < 9.0  # no log Z runaway
    # the issue: up to 10 minutes at the default size on 2 cores; measured 677 s with another
    # engineer's runs on the same 2 cores (load ~5), ~90 s per 1000-step variant when less loaded
    # (printed with the output; not asserted: the wall time says as much about the machine)


def test_post_norm_no_warmup(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, _ = stabkit(stabkit_cli, "run", "post-norm-no-warmup", "--jobs", "2", "--out", str(tmp_path / "o"))
    v = s["variants"]
    assert v["baseline"]["depth_grad_ratio"] > 0.9 and v["pre"]["depth_grad_ratio"] < 0.6
    assert verdicts(s)["baseline"] == "reproduced" and verdicts(s)["pre"] == "fixed"


@pytest.mark.parametrize("recipe", ["nan-injection", "loss-spike"])
def test_faults_are_caught_and_training_goes_on(tmp_path: Path, recipe: str, stabkit_cli: StabkitCLI) -> None:
    s, _ = stabkit(stabkit_cli, "run", recipe, "--jobs", "2", "--out", str(tmp_path / "o"))
    assert verdicts(s)["baseline"] == "reproduced" and verdicts(s)["skip"] == "fixed"
    assert s["variants"]["skip"]["fault_detected"] == 1.0


def test_low_precision_reproduces_with_eager_attention(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, text = stabkit(stabkit_cli, "run", "low-precision", "--jobs", "2", "--out", str(tmp_path / "o"))
    v = s["variants"]
    # measured (seed 0, 150 steps, LR 0.15, head_dim 64, loss scaling): the fp16 q·kᵀ overflowed at
    # step 30 in blocks.0.attn; every attention fix trained without a non-finite step (attention is
    # the run's only fp16 overflow): qk_norm 2.499, attn_softcap 2.622, qk_clip 2.570, fp32_softmax
    # 2.821; the rescue: entropy collapse at step 20, qk_clip on, back to step 0, 2.699 (+0.129 over
    # qk_clip from the start: not rescued; seeds 1 / 2 in test_low_precision_rescue_over_seeds)
    base = v["baseline"]
    assert verdicts(s)["baseline"] == "reproduced" and base["events/nonfinite"] >= 1
    first = next(e for e in base["event_list"] if e["kind"] == "nonfinite")
    assert first["where"] == "blocks.0.attn"
    for fix in ("qk_norm", "attn_softcap", "qk_clip", "fp32_softmax"):
        assert v[fix]["nonfinite_steps"] == 0 and v[fix]["val_loss"] < 4.0, fix  # nothing else overflows
        assert verdicts(s)[fix].startswith("fixed"), (fix, verdicts(s)[fix])
    assert v["qk_norm"]["max_attn_logit"] < 100
    assert v["attn_softcap"]["max_attn_logit_capped"] <= 30.0 + 1e-3
    assert v["fp32_softmax"]["max_attn_logit"] > 65504 / 8  # what an fp16 q·kᵀ (scale 1/8) could not hold
    check_rescue(v, verdicts(s)["rescue"])
    assert f"rescue: {verdicts(s)['rescue']}" in text and "rescue at step" in text


def check_rescue(v: dict[str, Any], verdict: str) -> None:
    """low-precision's rescue judged: qk_clip on before the baseline's first non-finite step, no
    non-finite step after it, and a verdict that follows from the held-out losses (qk_clip from the
    start is finite, so the rescue is always judged)."""
    rescue, clip = v["rescue"], v["qk_clip"]
    assert rescue["rescue_count"] >= 1 and rescue["rescue_fixes"][0] == "qk_clip"
    assert rescue["rescue_step"] < v["baseline"]["first_nonfinite_step"]
    assert rescue["nonfinite_steps"] == 0 and clip["nonfinite_steps"] == 0
    ours, theirs = float(rescue["val_loss"]), float(clip["val_loss"])
    assert math.isfinite(ours) and math.isfinite(theirs)
    assert verdict.rstrip("*") == ("rescued" if ours - theirs <= 0.1 else "not rescued"), (
        verdict,
        ours,
        theirs,
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_low_precision_rescue_over_seeds(tmp_path: Path, seed: int) -> None:
    # measured: seed 1 overflowed at step 29, rescued at step 20 (back to step 0), 2.668 vs qk_clip
    # 2.655 (+0.014: rescued); seed 2 at step 29, rescued at step 20, 2.614 vs 2.617 (-0.003: rescued)
    from stabkit.harness.recipes import load_recipe, run_recipe

    recipe = load_recipe("low-precision", "tiny", seed=seed)
    recipe.variants = [x for x in recipe.variants if x.name in ("baseline", "qk_clip", "rescue")]
    summary = run_recipe(recipe, tmp_path, workers=2)
    v = summary.variants
    assert all(r["status"] == "done" and r["steps_done"] == 150 for r in v.values())
    assert summary.verdicts["baseline"]["verdict"] == "reproduced"
    assert next(e for e in v["baseline"]["event_list"] if e["kind"] == "nonfinite")["where"].endswith(".attn")
    check_rescue(v, summary.verdicts["rescue"]["verdict"])


def test_muon_logit_growth(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, text = stabkit(stabkit_cli, "run", "muon-logit-growth", "--jobs", "2", "--out", str(tmp_path / "o"))
    v = s["variants"]
    base, clip, adamw = v["baseline"], v["qk_clip"], v["adamw"]
    # measured (seeds 0/1/2): Muon's max logit 501/490/487 against AdamW's 27.8/37.7/31.4 (18x/13x/16x);
    # QK-Clip at 30 held every clipped head at <= 40.9/45.3/44.9 (seed 1 just past tau*1.5 = 45: "not
    # fixed"), val 2.099/2.105/2.104 vs 2.227/2.233/2.246 unclipped; the rescue (entropy collapse at
    # step 55/60/55, back to step 20) 2.135/2.121/2.138 vs qk_clip from the start (+0.036/+0.016/+0.034)
    assert base["max_attn_logit"] >= 10 * adamw["max_attn_logit"] and verdicts(s)["baseline"] == "reproduced"
    ok = clip["qk_clip_max_after_clip"] <= 45.0 and clip["val_loss"] - base["val_loss"] < 0.05
    assert verdicts(s)["qk_clip"] == ("fixed" if ok else "not fixed")
    assert clip["qk_clip_heads_fraction"] > 0 and len(clip["qk_clip_share_curve"]) == 6
    assert "share of heads clipped per step" in text
    rescue = v["rescue"]
    assert rescue["rescue_fixes"] == ["qk_clip"]
    diff = rescue["val_loss"] - clip["val_loss"]
    assert verdicts(s)["rescue"] == ("rescued" if diff <= 0.1 else "not rescued")


def test_loss_spike_adaptive_clipping(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    s, text = stabkit(stabkit_cli, "run", "loss-spike", "--jobs", "2", "--out", str(tmp_path / "o"))
    v = s["variants"]
    # measured (seed 0): ZClip clipped 17 steps from step 150 (the bad batches), val 2.189; the
    # update-norm clip 7 steps, 2.205; the baseline 2.207, the clean run 2.135: neither fixed
    for name in ("zclip", "update_clip"):
        assert v[name]["clip_steps"] >= 1 and 150 <= v[name]["clip_first_step"] <= 160
        ok = v[name]["val_loss"] - v["clean"]["val_loss"] < 0.02 and v[name]["fault_detected"] == 1.0
        assert verdicts(s)[name] == ("fixed" if ok else "not fixed")
    assert "clip: " in text
