"""`Recipe` and `VariantSpec`: a whole stress test, resolved for one size, and its parsing.

`parse_recipe` runs once per load, on the TOML document with the chosen ``[sizes.<name>]`` table
already merged over the top level (`stabkit.harness.recipes.loader`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ....config import MonitorConfig
from ....detect_config import DetectConfig
from ...data.synthetic import SyntheticSpec
from ...models import PRESETS, GPTConfig
from ...models.spec import ModelSpec, ModelSpecError, parse_model_spec
from ...training import TrainConfig
from .arch import Adaptation
from .checks import VARIANT, Check, parse_checks
from .errors import RecipeError
from .fields import boolean, choice, string, table
from .rescue import RESCUE_TOLERANCE, with_rescue
from .schema import (
    DepthSpec,
    FaultSpec,
    SweepSpec,
    parse_depth,
    parse_detect,
    parse_fault,
    parse_model,
    parse_model_over,
    parse_monitor,
    parse_sweep,
    parse_synthetic,
    parse_train,
    train_defaults,
)

ROLES = ("baseline", "intervention", "reference", "rescue", "contrast")
TOP_KEYS = (
    "name", "description", "references", "size", "model", "data", "train", "monitor", "detect",
    "fault", "depth", "sweep", "variants", "criteria", "sizes",
)  # fmt: skip
SIZE_KEYS = (
    "expect",
    "note",
    "model",
    "train",
    "monitor",
    "detect",
    "fault",
    "depth",
    "sweep",
    "variants",
    "criteria",
)
VARIANT_KEYS = (
    "role", "description", "model", "interventions", "train", "fault", "detect", "fixed", "mechanism",
)  # fmt: skip
MODEL_FIXED = ("vocab_size", "context")
"""[model] keys a variant may not override: every variant trains and is judged on the same data."""
RESCUE_KEYS = ("role", "description", "detect", "mechanism", "tolerance")
"""Keys of a rescue variant: it trains the baseline's settings (`stabkit.harness.recipes.rescue`)."""
CRITERIA_KEYS = ("reproduced", "fixed")


@dataclass
class VariantSpec:
    """One arm of the comparison: the baseline, an intervention, a reference run, or a rescue."""

    name: str
    role: str
    """baseline (shows the instability), intervention (should fix it), reference (e.g. a safe LR),
    rescue (the baseline with stabkit allowed to act: action 'rescue', `stabkit.harness.recipes.rescue`),
    contrast (the baseline under other settings, showing what the instability costs there: judged by
    its own ``mechanism`` checks, "shown" / "not shown")."""
    train: TrainConfig
    """The recipe's training settings with this variant's overrides."""
    description: str = ""
    model: GPTConfig | None = None
    """The recipe's [model] with this variant's ``model`` table over it (None: the recipe's as is)."""
    interventions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Registry name -> options, applied with `stabkit.interventions.apply_many`."""
    fault: bool = True
    """Whether the recipe's [fault] is injected in this variant."""
    detect: DetectConfig = field(default_factory=DetectConfig)
    """The recipe's [detect] with this variant's settings over it (e.g. the action on an event)."""
    fixed: list[Check] | None = None
    """This intervention's own "fixed" checks (None: the recipe's [criteria] fixed)."""
    mechanism: list[Check] = field(default_factory=list)
    """Checks reported whatever the verdict (e.g. "z-loss lowers |log Z|")."""
    tolerance: float | None = None
    """A rescue variant's: "rescued" when its final held-out loss is at most this many nats above
    the fixed-from-the-start variant's (None for other roles)."""


@dataclass
class Recipe:
    """A stress test resolved for one size: what to train, what to compare, what counts."""

    name: str
    size: str
    model: GPTConfig
    train: TrainConfig
    variants: list[VariantSpec]
    reproduced: list[Check]
    """Checks on the baseline: all pass -> "reproduced"."""
    fixed: list[Check]
    """Default checks on interventions: all pass -> "fixed"."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """How the variants are monitored (the detectors: each variant's `detect`)."""
    description: str = ""
    references: list[str] = field(default_factory=list)
    data: str | SyntheticSpec | None = None
    """Path of the training text, or a synthetic Zipf language (``[data] synthetic = {...}``); None:
    the embedded default."""
    detect: DetectConfig = field(default_factory=DetectConfig)
    """The recipe's [detect] table (each variant may set more over it)."""
    fault: FaultSpec | None = None
    depth: DepthSpec | None = None
    sweep: SweepSpec = field(default_factory=SweepSpec)
    sizes: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per size: ``expect`` (what this size shows) and ``note``, for listings."""
    source: str = ""
    """File the recipe came from."""
    arch: ModelSpec | None = None
    """The model trained: None (or a preset) for the reference GPT, else a user's (``--model hf:llama``,
    ``[model] spec``) shaped by `model`'s size fields (`stabkit.harness.recipes.arch`)."""
    adaptation: Adaptation | None = None
    """On a user's model: the variants skipped and the switches it keeps its own way (`arch.adapt`)."""

    @property
    def baseline(self) -> VariantSpec:
        return next(v for v in self.variants if v.role == "baseline")

    def model_of(self, variant: VariantSpec) -> GPTConfig:
        """The GPTConfig `variant` trains: its own ``model`` table over the recipe's, else the recipe's."""
        return variant.model if variant.model is not None else self.model

    def variant(self, name: str) -> VariantSpec:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(
            f"recipe {self.name!r} has no variant {name!r}; variants: {[v.name for v in self.variants]}"
        )


def parse_interventions(raw: Any, where: str) -> dict[str, dict[str, Any]]:
    """{name: {option: value}}, each checked once by the intervention's own option check
    (`stabkit.interventions.check_options`: names, choices, ranges, the options dataclass)."""
    from ....interventions import ORDER, InterventionError, check_options, option_defaults
    from ....interventions.registry import plugin

    t = table(raw, where, tuple(ORDER))
    out: dict[str, dict[str, Any]] = {}
    for name, options in t.items():
        cls = plugin(name)
        opts = table(options, f"{where}.{name}", tuple(option_defaults(cls)))
        try:
            check_options(cls, opts)
        except InterventionError as exc:
            key = next((k for k in opts if exc.missing.startswith(f"{k} ")), None)
            raise RecipeError(f"{where}.{name}" + (f".{key}" if key else ""), exc.missing) from None
        out[name] = opts
    return out


def default_role(name: str) -> str:
    """The role of a variant whose table does not say: baseline and rescue by name, else intervention."""
    return name if name in ("baseline", "rescue") else "intervention"


def variant_role(name: str, raw: Any) -> str:
    """The role a [variants.<name>] table asks for."""
    role = raw.get("role", default_role(name)) if isinstance(raw, dict) else default_role(name)
    return choice(role, f"variants.{name}.role", ROLES)


def parse_rescue(name: str, raw: Any, baseline: VariantSpec) -> VariantSpec:
    """A rescue variant: the baseline's train settings, interventions and fault, the baseline's
    detectors with its own ``detect`` table over them, and the action 'rescue' added
    (`stabkit.harness.recipes.rescue.with_rescue`)."""
    where = f"variants.{name}"
    if isinstance(raw, dict):
        for key in ("model", "interventions", "train", "fault", "fixed"):
            if key in raw:
                raise RecipeError(
                    f"{where}.{key}",
                    "a rescue variant trains the baseline's settings (the rescue switches the fix on, and "
                    f"its verdict compares with the variant that had the fix from the start); allowed: "
                    f"{', '.join(RESCUE_KEYS)}",
                )
    t = table(raw, where, RESCUE_KEYS)
    detect = (
        parse_detect(t["detect"], f"{where}.detect", base=baseline.detect)
        if "detect" in t
        else baseline.detect
    )
    tolerance = t.get("tolerance", RESCUE_TOLERANCE)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not tolerance >= 0:
        raise RecipeError(
            f"{where}.tolerance", f"must be a number >= 0 (nats of held-out loss), got {tolerance!r}"
        )
    return VariantSpec(
        name=name,
        role="rescue",
        train=baseline.train,
        description=string(t.get("description", ""), f"{where}.description"),
        model=baseline.model,
        interventions={k: dict(v) for k, v in baseline.interventions.items()},
        fault=baseline.fault,
        detect=with_rescue(detect),
        mechanism=parse_checks(t.get("mechanism", []), f"{where}.mechanism"),
        tolerance=float(tolerance),
    )


def parse_variant(
    name: str, raw: Any, train: TrainConfig, detect: DetectConfig, model: GPTConfig
) -> VariantSpec:
    """One [variants.<name>] table (not a rescue): its model, train and detect tables over the recipe's."""
    where = f"variants.{name}"
    t = table(raw, where, VARIANT_KEYS)
    role = variant_role(name, t)
    fixed = parse_checks(t["fixed"], f"{where}.fixed") if "fixed" in t else None
    return VariantSpec(
        name=name,
        role=role,
        train=parse_train(t.get("train"), f"{where}.train", base=train),
        description=string(t.get("description", ""), f"{where}.description"),
        model=parse_variant_model(t.get("model"), f"{where}.model", model),
        interventions=parse_interventions(t.get("interventions"), f"{where}.interventions"),
        fault=boolean(t.get("fault", True), f"{where}.fault"),
        detect=parse_detect(t["detect"], f"{where}.detect", base=detect) if "detect" in t else detect,
        fixed=fixed,
        mechanism=parse_checks(t.get("mechanism", []), f"{where}.mechanism"),
    )


def parse_variant_model(raw: Any, where: str, base: GPTConfig) -> GPTConfig | None:
    """A variant's ``model`` table (GPTConfig fields over the recipe's [model]; not vocab_size or
    context), or None without one."""
    if raw is None:
        return None
    for key in MODEL_FIXED:
        if isinstance(raw, dict) and key in raw:
            raise RecipeError(f"{where}.{key}", "is the same for every variant: set it in [model]")
    return parse_model_over(raw, where, base)


ARCH_KEYS = ("spec", "options")
"""[model] keys naming the model to train instead of the reference GPT (``spec = "hf:llama"``, an
``[model.options]`` table), as ``--model`` / ``--model-option`` do."""


def parse_arch(raw: Any) -> ModelSpec | None:
    """The ``spec`` and ``options`` of a [model] table (removed from `raw`, a dict), or None."""
    if not isinstance(raw, dict) or "spec" not in raw:
        if isinstance(raw, dict) and "options" in raw:
            raise RecipeError("model.options", 'needs a model spec: set [model] spec = "hf:..."')
        return None
    text = string(raw.pop("spec"), "model.spec")
    options = raw.pop("options", {})
    if not isinstance(options, dict):
        raise RecipeError("model.options", "must be a table of config fields or factory arguments")
    try:
        return parse_model_spec(text, options)
    except ModelSpecError as exc:
        raise RecipeError("model.spec", str(exc)) from None


def parse_recipe(doc: dict[str, Any], size: str, name: str, source: str = "") -> Recipe:
    """A Recipe from a TOML document whose ``[sizes.<size>]`` table is already merged in."""
    t = table(doc, "", TOP_KEYS)
    size = choice(size, "size", tuple(PRESETS))
    train = parse_train(t.get("train"), "train", base=train_defaults(size))
    detect = parse_detect(t.get("detect"), "detect")
    raw_model = dict(t.get("model") or {}) if isinstance(t.get("model"), dict) else t.get("model")
    arch = parse_arch(raw_model)
    model = parse_model(raw_model, size)
    raw_variants = table(t.get("variants"), "variants", tuple(t.get("variants") or ()))
    if not raw_variants:
        raise RecipeError(
            "variants", "at least one [variants.<name>] table is needed (one with role baseline)"
        )
    parsed = {
        n: parse_variant(n, v, train, detect, model)
        for n, v in raw_variants.items()
        if variant_role(n, v) != "rescue"
    }
    baselines = [v.name for v in parsed.values() if v.role == "baseline"]
    if len(baselines) != 1:
        raise RecipeError(
            "variants", f"exactly one variant must have role baseline, found {baselines or 'none'}"
        )
    variants = [
        parsed[n] if n in parsed else parse_rescue(n, v, parsed[baselines[0]])
        for n, v in raw_variants.items()
    ]
    criteria = table(t.get("criteria"), "criteria", CRITERIA_KEYS)
    data = table(t.get("data"), "data", ("path", "synthetic"))
    if data.get("path") and data.get("synthetic") is not None:
        raise RecipeError("data", "give either path or synthetic, not both")
    sizes = {
        s: {
            k: string(v, f"sizes.{s}.{k}")
            for k, v in table(spec, f"sizes.{s}", SIZE_KEYS).items()
            if k in ("expect", "note")
        }
        for s, spec in (t.get("sizes") or {}).items()
    }
    recipe = Recipe(
        name=string(t.get("name", name), "name"),
        size=size,
        model=model,
        train=train,
        variants=variants,
        reproduced=parse_checks(criteria.get("reproduced", []), "criteria.reproduced"),
        fixed=parse_checks(criteria.get("fixed", []), "criteria.fixed"),
        monitor=parse_monitor(t.get("monitor")),
        description=string(t.get("description", ""), "description"),
        references=[string(r, "references") for r in t.get("references", [])],
        data=string(data["path"], "data.path")
        if data.get("path")
        else parse_synthetic(data.get("synthetic")),
        detect=detect,
        fault=parse_fault(t.get("fault")),
        depth=parse_depth(t.get("depth")),
        sweep=parse_sweep(t.get("sweep")),
        sizes=sizes,
        source=source,
        arch=arch,
    )
    _check_references(recipe)
    if isinstance(recipe.data, SyntheticSpec) and recipe.model.vocab_size != recipe.data.vocab:
        raise RecipeError(
            "data.synthetic.vocab",
            f"is {recipe.data.vocab}, so [model] needs vocab_size = {recipe.data.vocab} "
            f"(got {recipe.model.vocab_size})",
        )
    return recipe


def _check_references(recipe: Recipe) -> None:
    """Checks comparing with a reference need a reference variant; depth checks need [depth]."""
    has_ref = any(v.role == "reference" for v in recipe.variants)
    groups: list[tuple[str, list[Check]]] = [
        ("criteria.reproduced", recipe.reproduced),
        ("criteria.fixed", recipe.fixed),
    ]
    for v in recipe.variants:
        groups += [(f"variants.{v.name}.fixed", v.fixed or []), (f"variants.{v.name}.mechanism", v.mechanism)]
    names = {v.name for v in recipe.variants}
    for where, checks in groups:
        for c in checks:
            if c.vs is not None and c.vs.startswith(VARIANT) and c.vs[len(VARIANT) :] not in names:
                raise RecipeError(
                    f"{where}.vs",
                    f"names no variant of this recipe ({', '.join(sorted(names))}), got {c.vs!r}",
                )
            if c.vs == "reference" and not has_ref:
                raise RecipeError(where, "compares with vs = 'reference' but no variant has role reference")
            if c.metric == "depth_grad_ratio" and recipe.depth is None:
                raise RecipeError(where, "uses depth_grad_ratio, which needs a [depth] table")
            if c.metric.startswith("fault_") and recipe.fault is None:
                raise RecipeError(where, f"uses {c.metric}, which needs a [fault] table")
