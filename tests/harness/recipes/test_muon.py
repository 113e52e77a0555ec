"""Muon in the harness ([train] optimizer = "muon": torch.optim.Muon on the blocks' matrices, AdamW on
the rest) and the muon-logit-growth recipe shortened (the mechanism; the full verdicts are in
test_slow.py): Muon's attention logits outgrow AdamW's, QK-Clip holds them and logs what it did."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from stabkit.harness.models import GPT, preset_config
from stabkit.harness.recipes import RecipeError, load_recipe, run_recipe
from stabkit.harness.training import TrainConfig, make_optimizer
from stabkit.harness.training.loop import lr_at, optimizers

STEPS, MUON_LR = 60, 0.4
"""Shortened run at a higher Muon LR, so the growth comes within it: measured (seed 0) Muon's max
logit 407 against AdamW's 17.4; QK-Clip at 30 held each clipped head at <= 50 after its first clip."""


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest() -> None:
    torch.manual_seed(0)
    model = GPT(preset_config("tiny"))
    muon, adamw = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-2, muon_lr=0.1))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    rest = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert hidden == {n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")}
    assert {"tok_emb.weight", "head.weight"} <= rest and not hidden & rest
    assert muon.param_groups[0]["lr_ratio"] == pytest.approx(10.0)
    cfg = TrainConfig(optimizer="muon", lr=1e-2, muon_lr=0.1, steps=20, warmup=5)
    assert lr_at(3, cfg) * muon.param_groups[0]["lr_ratio"] == pytest.approx(0.1 * 4 / 5)
    assert optimizers([muon, adamw]) == [muon, adamw] and optimizers(adamw) == [adamw]


def test_the_recipe_checks_its_optimizer(tmp_path: Path) -> None:
    recipe = load_recipe("muon-logit-growth", "tiny")
    base, ref = recipe.baseline, recipe.variant("adamw")
    assert base.train.optimizer == "muon" and ref.train.optimizer == "adamw"
    assert recipe.variant("qk_clip").interventions == {"qk_clip": {"tau": 30.0}}
    with pytest.raises(RecipeError, match="train.optimizer"):
        bad = tmp_path / "muon-bad.toml"
        bad.write_text(Path(recipe.source).read_text().replace('optimizer = "muon"', 'optimizer = "sgd"'))
        load_recipe(bad, "tiny")


def test_muon_logits_outgrow_adamw_and_qk_clip_holds_them(tmp_path: Path) -> None:
    recipe = load_recipe("muon-logit-growth", "tiny", steps=STEPS)
    recipe.variants = [v for v in recipe.variants if v.name in ("baseline", "qk_clip", "adamw")]
    for v in recipe.variants:
        if v.train.optimizer == "muon":
            v.train = dataclasses.replace(v.train, muon_lr=MUON_LR)
    summary = run_recipe(recipe, tmp_path, workers=1)
    base, clip, ref = (summary.variants[n] for n in ("baseline", "qk_clip", "adamw"))
    assert base["max_attn_logit"] >= 10 * ref["max_attn_logit"] and base["max_attn_logit"] > 100
    assert summary.verdicts["baseline"]["verdict"] == "reproduced"
    # QK-Clip: every step clipped what passed 30; a head's max after its first clip stays near it
    assert 0 < clip["qk_clip_heads_fraction"] <= 1 and clip["qk_clip_steps"] > 0
    assert clip["qk_clip_max_after_clip"] < 2 * 30.0
    assert clip["max_attn_logit"] < base["max_attn_logit"] / 4
    assert len(clip["qk_clip_share_curve"]) == 6 and len(clip["qk_clip_fraction_curve"]) == 5
    assert clip["qk_clip_first_step"] <= clip["qk_clip_quiet_step"] < STEPS
    assert clip["val_loss"] < base["val_loss"] + 0.05
