"""Recipe loading: every shipped recipe parses for every size it defines; bad keys and values are
refused with one message naming the key and what is allowed; sizes and --steps override as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from stabkit.harness.models import PRESET_BATCH, PRESETS
from stabkit.harness.recipes import RecipeError, list_recipe_files, load_recipe
from stabkit.harness.recipes.spec.loader import builtin_dir, read_toml

SHIPPED = sorted(p.stem for p in builtin_dir().glob("*.toml"))
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
    path = builtin_dir() / f"{name}.toml"
    sizes = {"tiny", *read_toml(path).get("sizes", {})}
    for size in sizes:
        recipe = load_recipe(path, size)
        assert recipe.size == size and recipe.model.d_model == PRESETS[size]["d_model"]
        assert sum(v.role == "baseline" for v in recipe.variants) == 1
        assert recipe.reproduced or recipe.sweep.reproduced, "a recipe must say what 'reproduced' means"
    tiny = load_recipe(path, "tiny")
    assert tiny.sizes.get("tiny", {}).get("expect"), "the tiny table must say what to expect"


def test_tiny_presets_match_the_measured_cpu_proxy() -> None:
    r = load_recipe(builtin_dir() / "attention-logit-growth.toml", "tiny")
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


def test_a_variant_model_table_goes_over_the_recipe_model(tmp_path: Path) -> None:
    text = BASE.replace("[variants.qk_norm]", "[variants.qk_norm]\nmodel = { softmax_fp32 = true }")
    text += '\n[model]\nattention = "eager"\n[variants.rescue]\n'
    r = load_recipe(write(tmp_path, text), "gpt2")
    fp32, base = r.model_of(r.variant("qk_norm")), r.model_of(r.baseline)
    assert (fp32.attention, fp32.softmax_fp32, fp32.d_model) == ("eager", True, 768)  # over [model] and size
    assert base == r.model and (base.attention, base.softmax_fp32) == ("eager", False)
    assert r.model_of(r.variant("rescue")) == base  # a rescue trains the baseline's model


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
        (
            BASE.replace("[sizes.gpt2]", "[sizes.huge]"),
            "sizes.huge",
            "allowed: tiny, tiny-moe, small, gpt2, 1b",
        ),
        (BASE + "\n[model]\nd_modle = 3\n", "model.d_modle", "d_model"),
        (BASE + "\n[model]\nn_heads = 5\n", "model.n_heads", "must divide d_model"),
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
        (
            BASE + "\n[detect]\noptions = { spike = { sigma = -1 } }\n",
            "detect.options.spike.sigma",
            "must be a number in (0, inf)",
        ),
        (
            BASE + "\n[detect]\nspike_sigma = 1\n",
            "detect.spike_sigma",
            "unknown key; allowed: actions, detectors, options, sync, act_on",
        ),
        (
            BASE.replace("[variants.qk_norm]", '[variants.qk_norm]\nmodel = { attention = "flash" }'),
            "variants.qk_norm.model.attention",
            "must be one of sdpa, eager, got 'flash'",
        ),
        (
            BASE.replace("[variants.qk_norm]", "[variants.qk_norm]\nmodel = { context = 32 }"),
            "variants.qk_norm.model.context",
            "set it in [model]",
        ),
        (
            BASE + "\n[variants.rescue]\nmodel = { softmax_fp32 = true }\n",
            "variants.rescue.model",
            "trains the baseline's settings",
        ),
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
    with pytest.raises(RecipeError, match="size: must be one of tiny, tiny-moe, small, gpt2, 1b"):
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


# ---- built-in recipes: the top-level recipes/ folder, found by name, old paths still work


def test_builtin_recipes_are_the_top_level_recipes_folder() -> None:
    """One copy, ``recipes/`` beside pyproject.toml; the wheel ships it (tests/harness/recipes/test_packaging.py)."""
    folder = Path(__file__).resolve().parents[4] / "recipes"
    names = {p.name for p in folder.iterdir() if p.name.endswith(".toml")}
    assert names >= {f"{n}.toml" for n in REQUIRED}
    assert builtin_dir().samefile(folder)


def test_a_bare_name_finds_the_builtin_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stabkit.harness.recipes.spec.loader import find_recipe

    monkeypatch.chdir(tmp_path)  # no ./recipes here: the built-ins answer
    assert find_recipe("attention-logit-growth") == builtin_dir() / "attention-logit-growth.toml"
    assert load_recipe("loss-spike").name == "loss-spike"


def test_a_local_recipes_folder_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stabkit.harness.recipes.spec.loader import find_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    mine = write(tmp_path / "recipes", BASE, "loss-spike.toml")
    assert find_recipe("loss-spike").resolve() == mine.resolve()
    assert find_recipe("recipes/loss-spike.toml").resolve() == mine.resolve()  # an existing path is that file


def test_an_old_style_path_names_the_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stabkit.harness.recipes.spec.loader import find_recipe

    monkeypatch.chdir(tmp_path)
    old = "recipes/attention-logit-growth.toml"  # the repository's path, typed in another folder
    assert not (tmp_path / old).exists()
    assert find_recipe(old) == builtin_dir() / "attention-logit-growth.toml"
    assert load_recipe(old).name == "attention-logit-growth"
    with pytest.raises(FileNotFoundError, match="elsewhere/attention-logit-growth.toml"):
        find_recipe("elsewhere/attention-logit-growth.toml")  # only the old folder name falls back


def test_an_unknown_name_lists_the_builtins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stabkit.harness.recipes.spec.loader import find_recipe

    monkeypatch.chdir(tmp_path)
    for spec in ("no-such-recipe", "recipes/no-such-recipe.toml"):
        with pytest.raises(FileNotFoundError) as info:
            find_recipe(spec)
        message = str(info.value)
        assert "\n" not in message and spec in message
        assert all(name in message for name in REQUIRED)


# ---- the one table -> dataclass loader (stabkit.tables.fill) behind every recipe table


@pytest.mark.parametrize(
    ("table", "key", "problem"),
    [
        ({"stepz": 3}, "train.stepz", "unknown key; allowed: steps, batch_size, lr"),
        ({"steps": "many"}, "train.steps", "must be an integer >= 1, got 'many'"),
        ({"steps": True}, "train.steps", "must be an integer >= 1, got True"),
        ({"steps": 0}, "train.steps", "must be an integer >= 1, got 0"),
        ({"lr": 0}, "train.lr", "must be a number in (0, inf), got 0"),
        ({"betas": [0.9]}, "train.betas", "must be an array of 2 values"),
        ({"betas": [0.9, 1.0]}, "train.betas[1]", "must be a number in [0, 1), got 1.0"),
        ({"clip": -1.0}, "train.clip", 'must be a number in (0, inf) or "none", got -1.0'),
        ({"precision": "fp8"}, "train.precision", "must be one of fp32, bf16, fp16, got 'fp8'"),
        ({"batch_size": 5000}, "train.batch_size", "set train.grad_accum"),
    ],
)
def test_fill_names_section_key_and_what_is_allowed(table: dict[str, object], key: str, problem: str) -> None:
    from stabkit.harness.training import TrainConfig
    from stabkit.tables import TableError, fill

    with pytest.raises(TableError) as info:
        fill(TrainConfig, table, "train")
    assert info.value.key == key and problem in info.value.problem, str(info.value)
    assert "\n" not in str(info.value)


def test_fill_converts_and_keeps_the_base() -> None:
    from stabkit import DetectConfig, MonitorConfig
    from stabkit.harness.training import TrainConfig
    from stabkit.tables import fill

    base = TrainConfig(eval_batches=32)
    cfg = fill(TrainConfig, {"lr": 1, "betas": [0.9, 0.99], "clip": "none"}, "train", base)
    assert (cfg.lr, cfg.betas, cfg.clip, cfg.eval_batches) == (1.0, (0.9, 0.99), None, 32)
    assert isinstance(cfg.lr, float) and base.lr == 1e-2  # the base is not changed
    mon = fill(MonitorConfig, {"families": ["loss", "grad"], "attn_sample_rows": "none"}, "monitor")
    assert mon.families == frozenset({"loss", "grad"}) and mon.attn_sample_rows is None
    det = fill(
        DetectConfig,
        {
            "actions": {"spike": ["skip", "dump"]},
            "options": {"spike": {"series": ["loss"]}},
            "act_on": "info",
        },
        "detect",
    )
    assert det.actions["spike"] == ("skip", "dump") and det.options_for("spike").series == ("loss",)
    over = fill(
        DetectConfig, {"options": {"spike": {"window": 64}, "rollback": {"snapshots": 3}}}, "detect", det
    )
    assert over.options == {
        "spike": {"series": ["loss"], "window": 64},
        "rollback": {"snapshots": 3},
    }  # laid over


def test_fill_reraises_the_dataclass_own_check_naming_the_field() -> None:
    from stabkit import DetectConfig, MonitorConfig
    from stabkit.harness.models import GPTConfig
    from stabkit.tables import TableError, fill

    cases = [
        (MonitorConfig, {"attn_chunk_bytes": 10}, "monitor.attn_chunk_bytes"),
        (DetectConfig, {"options": {"drift": {"window": 2}}}, "detect.options.drift.window"),
        (DetectConfig, {"actions": {"spike": "explode"}}, "detect.actions"),
        (GPTConfig, {"d_model": 64, "n_heads": 5}, "model.n_heads"),
        (GPTConfig, {"positions": "rope", "d_model": 12, "n_heads": 4}, "model"),  # names no field
    ]
    for cls, table, key in cases:
        with pytest.raises(TableError) as info:
            fill(cls, table, key.split(".")[0])
        assert info.value.key == key, str(info.value)


def test_recipe_defaults_that_differ_from_the_library_are_kept(tmp_path: Path) -> None:
    from stabkit import MonitorConfig
    from stabkit.harness.recipes.spec.schema import RECIPE_DEFAULTS
    from stabkit.harness.training import TrainConfig

    r = load_recipe(write(tmp_path, BASE), "tiny")
    assert (
        r.train.eval_batches == RECIPE_DEFAULTS["train"]["eval_batches"] == 32 != TrainConfig().eval_batches
    )
    assert r.monitor.attn_every == RECIPE_DEFAULTS["monitor"]["attn_every"] == 5 != MonitorConfig().attn_every
    assert (
        r.train.batch_size == PRESET_BATCH["tiny"]
        and load_recipe(write(tmp_path, BASE), "gpt2").train.batch_size == 32
    )
    with pytest.raises(RecipeError, match=r"monitor\.detect: unknown key"):
        load_recipe(write(tmp_path, BASE + "\n[monitor]\ndetect = 1\n"), "tiny")
