"""A recipe on a model the project did not write (stabkit/harness/recipes/spec/arch.py, --model): the GPT's
switches become interventions or skip what cannot apply, with the reason; the fault finds its place by
discovery; the run trains the user's model."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from stabkit.harness.models.spec import parse_model_spec
from stabkit.harness.recipes import load_recipe, preflight, run_recipe
from stabkit.harness.recipes.run.faults import fault_module
from stabkit.harness.recipes.spec.arch import RecipeNotApplicable

LLAMA = parse_model_spec("hf:llama")


def test_low_precision_on_llama_skips_what_llama_has_no_switch_for() -> None:
    recipe = load_recipe("low-precision", model=LLAMA)
    names = [v.name for v in recipe.variants]
    assert "fp32_softmax" not in names and "baseline" in names
    assert recipe.adaptation is not None
    assert "softmax_fp32" in recipe.adaptation.skipped["fp32_softmax"]
    # the GPT's model-table soft cap becomes the intervention with the same cap
    assert recipe.variant("attn_softcap").interventions == {"attn_softcap": {"cap": 30.0}}
    # the n_heads = 1 variant is a size change: it carries over (GPT-2's head width)
    heads = [v for v in recipe.variants if v.model is not None and v.model.n_heads == 1]
    assert heads, names


def test_a_recipe_level_switch_applies_to_every_variant_as_an_intervention() -> None:
    recipe = load_recipe("output-logit-divergence", model=LLAMA)
    assert all("qk_norm" in v.interventions for v in recipe.variants)
    assert recipe.variant("z_loss").interventions["z_loss"] == {"coef": 1e-4}  # its own kept
    assert recipe.adaptation is not None and any("qk_norm" in n for n in recipe.adaptation.notes)


def test_a_post_norm_recipe_does_not_apply_to_a_pre_norm_model() -> None:
    with pytest.raises(RecipeNotApplicable, match="needs a post-norm model .*hf:llama is pre-norm: skipped"):
        load_recipe("post-norm-no-warmup", model=LLAMA)


POST_NORM_FACTORY = textwrap.dedent(
    """
    from stabkit.harness.models import GPT, GPTConfig

    def post_norm(vocab_size, context, d_model, n_layers, n_heads):
        return GPT(GPTConfig(vocab_size=vocab_size, context=context, d_model=d_model, n_layers=n_layers,
                             n_heads=n_heads, norm_placement="post"))
    """
)


def test_a_post_norm_recipe_applies_to_a_users_post_norm_model(tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text(POST_NORM_FACTORY)
    recipe = load_recipe("post-norm-no-warmup", model=parse_model_spec(f"{path}:post_norm"))
    assert recipe.baseline.name == "baseline" and recipe.adaptation is not None
    assert recipe.depth is None and any("[depth]" in n for n in recipe.adaptation.notes)
    checks = [*recipe.reproduced, *(c for v in recipe.variants for c in [*v.mechanism, *(v.fixed or [])])]
    assert checks and all(c.metric != "depth_grad_ratio" for c in checks)  # nothing left to read it
    # its variants relocate norms by intervention, which a discovered post-norm model takes
    assert {"pre", "sandwich"} <= {v.name for v in recipe.variants}


def test_the_faults_gpt_path_is_found_by_discovery_on_another_model() -> None:
    from stabkit.harness.models import GPTConfig
    from stabkit.harness.models.build import build

    model = build(LLAMA, GPTConfig())
    assert fault_module(model, "blocks.1.mlp.fc") == "model.model.layers.1.mlp.gate_proj"
    assert fault_module(model, "blocks.7.attn") == "model.model.layers.1.self_attn.q_proj"  # clamped
    assert fault_module(model, "lm_head") == "lm_head"  # not a GPT block path: as written


def test_nan_injection_on_llama_is_found_and_localized(tmp_path: Path) -> None:
    recipe = load_recipe("nan-injection", steps=24, model=LLAMA)
    recipe.variants = [v for v in recipe.variants if v.name in ("baseline", "skip")]
    preflight(recipe)
    summary = run_recipe(recipe, tmp_path)
    base = summary.variants["baseline"]
    assert base["status"] == "done" and base["fault_detected"] == 1.0, base
    assert base["fault_localized"] == 1.0, base  # named: model.model.layers.1.mlp.gate_proj
    assert summary.arch is not None and summary.arch["spec"] == "hf:llama"
    # the skip action keeps the poisoned step out of the weights: its loss stays finite
    assert summary.variants["skip"]["nonfinite_steps"] <= 1


def test_a_recipe_file_names_its_model_in_its_model_table(tmp_path: Path) -> None:
    from stabkit.harness.recipes.spec.errors import RecipeError
    from stabkit.harness.recipes.spec.loader import builtin_dir

    text = (builtin_dir() / "attention-logit-growth.toml").read_text()
    table = '[model]\nspec = "hf:mixtral"\nnorm_placement = "pre"\n\n[model.options]\nnum_local_experts = 4\n'
    path = tmp_path / "mine.toml"
    path.write_text(text.replace('[model]\nnorm_placement = "pre"\n', table))
    recipe = load_recipe(path)
    assert recipe.arch is not None and recipe.arch.text == "hf:mixtral"
    assert recipe.arch.options == {"num_local_experts": 4}
    assert recipe.adaptation is not None and recipe.adaptation.spec.kind == "hf"
    assert load_recipe(path, model=LLAMA).arch == LLAMA  # --model wins over the file
    path.write_text(text.replace('[model]\nnorm_placement = "pre"\n', '[model]\nspec = "gpt3"\n'))
    with pytest.raises(RecipeError, match="model.spec.*unknown model spec 'gpt3'"):
        load_recipe(path)
