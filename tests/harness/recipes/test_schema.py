"""Recipe loading: every shipped recipe parses for every size it defines; bad keys and values are
refused with one message naming the key and what is allowed; sizes and --steps override as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from stabkit.models import PRESET_BATCH, PRESETS
from stabkit.recipes import RecipeError, list_recipe_files, load_recipe
from stabkit.recipes.loader import SOURCE_RECIPES, read_toml

SHIPPED = sorted(p.stem for p in SOURCE_RECIPES.glob("*.toml"))
REQUIRED = {
    "attention-logit-growth",
    "output-logit-divergence",
    "post-norm-no-warmup",
    "lr-sensitivity",
    "nan-injection",
    "loss-spike",
    "low-precision",
}

BASE = """
name = "t"
[train]
steps = 40
lr = 0.1
[variants.baseline]
[variants.qk_norm]
interventions = { qk_norm = { kind = "layernorm" } }
[criteria]
reproduced = [{ metric = "max_attn_logit", op = ">", value = 1e3 }]
fixed = [{ metric = "max_attn_logit", op = "<", value = 100 }]
[sizes.gpt2]
train = { steps = 5000, lr = 3e-2 }
"""


def write(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_required_recipes_ship() -> None:
    assert set(SHIPPED) >= REQUIRED
    assert {p.stem for p in list_recipe_files()} >= REQUIRED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_recipe_loads_for_each_size_it_defines(name: str) -> None:
    path = SOURCE_RECIPES / f"{name}.toml"
    sizes = {"tiny", *read_toml(path).get("sizes", {})}
    for size in sizes:
        recipe = load_recipe(path, size)
        assert recipe.size == size and recipe.model.d_model == PRESETS[size]["d_model"]
        assert sum(v.role == "baseline" for v in recipe.variants) == 1
        assert recipe.reproduced or recipe.sweep.reproduced, "a recipe must say what 'reproduced' means"
    tiny = load_recipe(path, "tiny")
    assert tiny.sizes.get("tiny", {}).get("expect"), "the tiny table must say what to expect"


def test_tiny_presets_match_the_measured_cpu_proxy() -> None:
    r = load_recipe(SOURCE_RECIPES / "attention-logit-growth.toml", "tiny")
    m, t = r.model, r.train
    assert (m.d_model, m.n_layers, m.n_heads, m.context) == (64, 2, 4, 64)
    assert (t.steps, t.warmup, t.lr, t.betas, t.eps, t.clip) == (300, 15, 0.1, (0.9, 0.95), 1e-8, 1.0)
    assert t.independent_decay and t.weight_decay == 1e-4
    assert (t.batch_size or PRESET_BATCH["tiny"]) == 16
    assert r.variant("qk_norm").interventions == {"qk_norm": {"kind": "layernorm"}}


def test_size_table_overrides_model_and_train(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    tiny, gpt2 = load_recipe(path, "tiny"), load_recipe(path, "gpt2")
    assert (tiny.train.steps, tiny.train.lr, tiny.model.d_model) == (40, 0.1, 64)
    assert (gpt2.train.steps, gpt2.train.lr, gpt2.model.d_model) == (5000, 3e-2, 768)
    # a variant inherits the resolved train settings
    assert gpt2.variant("qk_norm").train.lr == 3e-2


def test_steps_override_scales_the_fault_and_caps_warmup() -> None:
    r = load_recipe("nan-injection", "tiny", steps=30, seed=5)
    assert r.fault is not None and r.fault.step == 150 * 30 // 300
    assert all(v.train.steps == 30 and v.train.warmup <= 6 and v.train.seed == 5 for v in r.variants)


@pytest.mark.parametrize(
    ("text", "key", "allowed"),
    [
        (BASE.replace("lr = 0.1", "lrr = 0.1"), "train.lrr", "allowed: steps, batch_size, lr"),
        (BASE.replace("lr = 0.1", "lr = -0.1"), "train.lr", "must be a number in (0, inf)"),
        (BASE.replace("steps = 40", "steps = 0"), "train.steps", "integer >= 1"),
        (BASE + "\n[train2]\n", "train2", "allowed: name, description"),
        (
            BASE.replace('kind = "layernorm"', 'kind = "batchnorm"'),
            "variants.qk_norm.interventions.qk_norm.kind",
            "layernorm",
        ),
        (
            BASE.replace("qk_norm = { kind", "qk_nrm = { kind"),
            "variants.qk_norm.interventions.qk_nrm",
            "z_loss",
        ),
        (BASE.replace('op = ">"', 'op = "gt"'), "criteria.reproduced[0].op", "< <= > >="),
        (
            BASE.replace('metric = "max_attn_logit", op = ">"', 'metric = "max_logit", op = ">"'),
            "criteria.reproduced[0].metric",
            "max_attn_logit",
        ),
        (BASE.replace("[sizes.gpt2]", "[sizes.huge]"), "sizes.huge", "allowed: tiny, small, gpt2, 1b"),
        (BASE + "\n[model]\nd_modle = 3\n", "model.d_modle", "d_model"),
        (BASE + "\n[model]\nn_heads = 5\n", "model", "must divide d_model"),
        (BASE.replace("lr = 0.1", 'lr = 0.1\nprecision = "fp8"'), "train.precision", "fp32, bf16, fp16"),
        (
            BASE.replace("[variants.baseline]", '[variants.baseline]\nrole = "boss"'),
            "variants.baseline.role",
            "baseline, intervention, reference",
        ),
        (
            BASE.replace('op = "<", value = 100', 'op = "<", value = 100, vs = "reference"'),
            "criteria.fixed",
            "no variant has role reference",
        ),
        (BASE + '\n[fault]\nkind = "nan"\nstep = 40\n', "fault.step", "below train.steps = 40"),
        (BASE + '\n[fault]\nkind = "meteor"\nstep = 4\n', "fault.kind", "nan, inf, bad_batch"),
        (BASE + "\n[detect]\nspike_sigma = -1\n", "detect", "spike_sigma"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(
    tmp_path: Path, text: str, key: str, allowed: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, "tiny")
    message = str(info.value)
    assert info.value.key == key, message
    assert allowed in message and str(path) in message and "\n" not in message


def test_unknown_size_and_missing_file_and_bad_syntax(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="size: must be one of tiny, small, gpt2, 1b"):
        load_recipe(write(tmp_path, BASE), "huge")
    with pytest.raises(FileNotFoundError, match="attention-logit-growth"):
        load_recipe(tmp_path / "nope.toml")
    with pytest.raises(RecipeError, match="syntax"):
        load_recipe(write(tmp_path, "name = = 3"), "tiny")


def test_a_recipe_needs_exactly_one_baseline(tmp_path: Path) -> None:
    text = BASE.replace("[variants.baseline]", '[variants.base]\nrole = "intervention"')
    with pytest.raises(RecipeError, match="exactly one variant must have role baseline"):
        load_recipe(write(tmp_path, text), "tiny")


def test_data_path_is_relative_to_the_recipe_and_cli_data_wins(tmp_path: Path) -> None:
    (tmp_path / "my.txt").write_text("x" * 2000)
    path = write(tmp_path, BASE + '\n[data]\npath = "my.txt"\n')
    assert load_recipe(path).data == str((tmp_path / "my.txt").resolve())
    (tmp_path / "elsewhere.txt").write_text("y" * 2000)  # --data is checked at load too: it must exist
    assert load_recipe(path, data=str(tmp_path / "elsewhere.txt")).data == str(tmp_path / "elsewhere.txt")
