"""A recipe on a model the project did not write (`hf:<type>`, `module:callable`): which of the recipe's
switches carry over, which become interventions, and what cannot apply (skipped, with the reason).

Runs once, when a command loads a recipe with a model spec (`adapt`, from `load_recipe`). A recipe's
``[model]`` table and its variants' ``model`` tables are written for the reference GPT. On another model:

- the size fields (width, layers, heads, kv heads, MLP width, dropout, vocabulary, context) shape it,
  through the config's own fields or the factory's arguments (`stabkit.harness.models.build`);
- ``attention = "eager"`` asks for materialised attention logits: Hugging Face's eager attention; a
  factory's model keeps its own (a note says so);
- ``qk_norm``, ``attn_softcap`` and ``logit_softcap`` become the interventions of the same names,
  applied through discovery as on the reference GPT (a variant's own interventions win);
- ``norm_placement`` is compared with the placement discovery finds: a recipe written for another
  placement (post-norm-no-warmup on a pre-norm model) cannot run, a variant that moves it is skipped;
- the other switches (norm kind, MLP kind, positions, biases, init, tied embeddings) describe the
  reference GPT: at the recipe level the model keeps its own (a note), a variant that changes one is
  skipped, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ...models import GPTConfig, preset_config
from ...models.spec import ModelSpec

SIZE_FIELDS = ("vocab_size", "context", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "dropout")
"""GPTConfig fields that shape any model (`stabkit.harness.models.build`)."""
AS_INTERVENTION = ("qk_norm", "attn_softcap", "logit_softcap")
"""GPTConfig switches with an intervention of the same effect."""
KERNEL_FIELDS = ("attention",)
PLACEMENT = "norm_placement"


class RecipeNotApplicable(ValueError):
    """The recipe's trigger cannot be set up on this model (its baseline cannot run); one line."""


@dataclass
class Adaptation:
    """What `adapt` decided, kept on the recipe and written to the summary."""

    spec: ModelSpec
    skipped: dict[str, str]
    """Variant -> why it cannot run on this model."""
    notes: list[str]
    """Switches of the recipe the model keeps its own way (one line each)."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "skipped": dict(self.skipped), "notes": list(self.notes)}


def changed(config: GPTConfig, base: GPTConfig) -> dict[str, Any]:
    """Fields of `config` that differ from `base`."""
    return {
        f.name: getattr(config, f.name)
        for f in fields(config)
        if getattr(config, f.name) != getattr(base, f.name)
    }


def as_interventions(config: GPTConfig, switches: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The interventions that do what `switches` (GPTConfig fields in `AS_INTERVENTION`) do on the GPT."""
    out: dict[str, dict[str, Any]] = {}
    if switches.get("qk_norm"):
        out["qk_norm"] = {"kind": "rmsnorm" if config.norm == "rmsnorm" else "layernorm"}
    if switches.get("attn_softcap"):
        out["attn_softcap"] = {"cap": float(switches["attn_softcap"])}
    if switches.get("logit_softcap"):
        out["logit_softcap"] = {"cap": float(switches["logit_softcap"])}
    return out


def adapt(recipe: Any, spec: ModelSpec, placement: str | None) -> Adaptation:
    """Fit `recipe` (a `Recipe`, changed in place) to the model of `spec`, whose discovered norm
    placement is `placement` (None: unknown). Raises RecipeNotApplicable when the baseline cannot run."""
    neutral = preset_config(recipe.size)
    base = recipe.model
    notes: list[str] = []
    recipe_switches = changed(base, neutral)
    shared = as_interventions(base, {k: v for k, v in recipe_switches.items() if k in AS_INTERVENTION})
    wanted = recipe_switches.get(PLACEMENT)
    if wanted is not None and placement != wanted:
        raise RecipeNotApplicable(
            f"{recipe.name} needs a {wanted}-norm model (its trigger); {spec.text} is "
            f"{placement + '-norm' if placement else 'of a placement discovery could not tell'}: skipped"
        )
    if recipe_switches.get("attention") == "eager" and spec.kind != "hf":
        notes.append(f"[model] attention = 'eager': {spec.text} keeps its own attention kernel")
    for name in sorted(recipe_switches):
        if name not in (*SIZE_FIELDS, *AS_INTERVENTION, *KERNEL_FIELDS, PLACEMENT):
            notes.append(
                f"[model] {name} = {recipe_switches[name]!r} describes the reference GPT: {spec.text} keeps its own"
            )
    if shared:
        notes.append(f"[model] switches applied as interventions on every variant: {', '.join(shared)}")
    skipped: dict[str, str] = {}
    kept = []
    for variant in recipe.variants:
        reason = variant_problem(recipe, variant, base, spec)
        if reason is not None:
            skipped[variant.name] = reason
            continue
        own = changed(recipe.model_of(variant), base)
        variant.interventions = {
            **shared,
            **as_interventions(
                recipe.model_of(variant), {k: v for k, v in own.items() if k in AS_INTERVENTION}
            ),
            **variant.interventions,
        }
        kept.append(variant)
    if recipe.baseline.name in skipped:
        raise RecipeNotApplicable(f"{recipe.name} on {spec.text}: baseline {skipped[recipe.baseline.name]}")
    recipe.variants = kept
    if recipe.depth is not None:
        recipe.depth = None
        notes.append(
            "[depth] (the init-time depth sweep) builds the reference GPT at several depths: not run"
        )
        drop_depth_checks(recipe)
    return Adaptation(spec, skipped, notes)


def drop_depth_checks(recipe: Any) -> None:
    """Without [depth], the checks that read ``depth_grad_ratio`` have nothing to read: removed."""

    def keep(checks: list[Any]) -> list[Any]:
        return [c for c in checks if c.metric != "depth_grad_ratio"]

    recipe.reproduced, recipe.fixed = keep(recipe.reproduced), keep(recipe.fixed)
    for variant in recipe.variants:
        variant.mechanism = keep(variant.mechanism)
        if variant.fixed is not None:
            variant.fixed = keep(variant.fixed)


def variant_problem(recipe: Any, variant: Any, base: GPTConfig, spec: ModelSpec) -> str | None:
    """Why `variant` cannot run on the model of `spec`, or None."""
    own = changed(recipe.model_of(variant), base)
    if PLACEMENT in own:
        return f"moves the reference GPT's norms to {own[PLACEMENT]!r} in its model table, which {spec.text} has no switch for"
    others = sorted(k for k in own if k not in (*SIZE_FIELDS, *AS_INTERVENTION))
    if others:
        return f"changes {', '.join(others)} of the reference GPT, which {spec.text} has no switch for"
    return None


def placement_of(spec: ModelSpec, size: GPTConfig) -> str | None:
    """The norm placement discovery finds in the model of `spec` (built on the meta device: no memory),
    when every block agrees; None when they differ or discovery cannot tell. Raises ModelSpecError when
    the model cannot be built."""
    import torch

    from ....discovery import inspect_model
    from ...models.build import build

    with torch.device("meta"):
        model = build(spec, size)
    try:
        placements = {b.placement for b in inspect_model(model).blocks}
    except Exception:  # discovery on the meta device is best effort; the worker builds on the CPU
        return None
    return placements.pop() if len(placements) == 1 and None not in placements else None
