"""THE advice table: which intervention to try for which event signature. One place; printed by
`stabkit list advice` (`describe_advice`).

`advise(event, model_map)` runs when an event is reported: it picks the signature from the
event's kind, series / module and pass (and the block's norm placement from the ModelMap) and
fills `Event.advice` ("qk_norm or attn_softcap: ...") and `details['advice' | 'interventions']`.
Intervention names are registry names of `stabkit.interventions`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..events import Event

if TYPE_CHECKING:  # annotations only: `stabkit list advice` prints this table without torch
    from ..discovery import ModelMap


@dataclass(frozen=True)
class Advice:
    """One row of the table."""

    when: str
    """The signature in words."""
    interventions: tuple[str, ...]
    """Registry names to switch on (empty: a setting or a check, not an intervention)."""
    text: str
    """What to do, and the source."""


ADVICE: dict[str, Advice] = {
    "attn_logit_growth": Advice(
        "max attention logit keeps growing",
        ("qk_norm", "attn_softcap"),
        "normalise q and k (ViT-22B; Wortsman et al. 2023: runs above 1e4 diverged) or soft-cap attention logits at 50 (Gemma 2)",
    ),
    "logz_drift": Advice(
        "log Z drifts away from log V",
        ("z_loss", "logit_softcap"),
        "add z-loss 1e-4·log²Z (PaLM; OLMo 2 / Chameleon use 1e-5) or soft-cap output logits at 30 (Gemma 2); weight decay also helps (Wortsman et al. 2023)",
    ),
    "residual_growth_post": Advice(
        "residual RMS grows in a post-norm model",
        ("norm_placement",),
        "move the norms to pre (Xiong et al. 2020) or sandwich placement; post-norm also needs a long warmup",
    ),
    "residual_growth_pre": Advice(
        "residual RMS grows in a pre-norm model",
        ("norm_placement", "rmsnorm"),
        "sandwich / reordered norm h = x + norm(f(x)) with RMSNorm (OLMo 2, Chameleon 34B) bounds what each block adds",
    ),
    "early_grad_blowup_post": Advice(
        "gradient-norm spike in an early block of a post-norm model",
        ("norm_placement",),
        "post-norm gradients near the input are large at init (Xiong et al. 2020): switch to pre or sandwich norm, or lengthen warmup",
    ),
    "grad_spike": Advice(
        "gradient-norm spike",
        (),
        "clip the gradient norm (1.0), lower the peak learning rate or lengthen warmup; spikes from the embeddings: no weight decay on them (OLMo 2)",
    ),
    "update_spike": Advice(
        "update/parameter ratio spike",
        (),
        "lower the learning rate or lengthen warmup; check Adam ε (1e-8; Wortsman et al. 2023 §3.4); update spikes precede loss spikes (marin#1368)",
    ),
    "loss_spike": Advice(
        "loss spike",
        (),
        "PaLM: restart ~100 steps earlier and skip 200–500 batches (action 'rollback'); the grad-norm and update-ratio events just before it name the layer",
    ),
    "nonfinite_attention": Advice(
        "NaN/Inf produced inside attention",
        ("qk_norm", "attn_softcap"),
        "attention logits overflowed the softmax: normalise q and k or soft-cap the logits; keep the softmax in float32",
    ),
    "nonfinite_output": Advice(
        "NaN/Inf at the output head / log Z",
        ("z_loss", "logit_softcap"),
        "output logits overflowed: z-loss keeps log Z near 0, a logit soft cap (30) bounds the logits",
    ),
    "nonfinite_norm": Advice(
        "NaN/Inf produced by a norm layer",
        (),
        "compute the norm in float32 and check its eps; non-finite weights came from an earlier update (rollback)",
    ),
    "nonfinite_forward": Advice(
        "NaN/Inf produced by a module in the forward pass",
        (),
        "check the module for overflow under bf16/fp16 (autocast), log/div/sqrt of non-positive values, and its weights",
    ),
    "nonfinite_backward": Advice(
        "NaN/Inf produced in the backward pass",
        (),
        "gradient overflow: lower the learning rate or the loss scale, clip gradients; in attention also try qk_norm",
    ),
    "nonfinite_optimizer": Advice(
        "NaN/Inf in optimizer state or update",
        (),
        "roll back to the last good state; lower the learning rate; check Adam ε and the second moment (exp_avg_sq) of the named parameter",
    ),
    "nonfinite_input": Advice(
        "the batch holds NaN/Inf", (), "fix the data pipeline; skip the batch (action 'skip')"
    ),
    "nonfinite_loss": Advice(
        "the loss computation produced NaN/Inf",
        (),
        "the model output was finite: check the loss code (log of 0, division by a zero count, all-masked targets)",
    ),
    "nonfinite_unknown": Advice(
        "NaN/Inf not reproduced on replay",
        (),
        "a transient fault (hardware?) or a norm that overflowed float32: skip the step or roll back",
    ),
    "nonfinite_repeat": Advice(
        "NaN/Inf again on the next step",
        (),
        "the weights or optimizer state stay broken: roll back (action 'rollback') or stop and resume from a checkpoint",
    ),
    "nonfinite_unlocalized": Advice(
        "NaN/Inf seen at the log interval",
        (),
        "set DetectConfig(actions={'nonfinite': 'skip'}) or sync=True to decide per step, skip the update and name the module",
    ),
}


def _inside(path: str, roots: list[str]) -> bool:
    return any(r and (path == r or path.startswith(r + ".")) for r in roots)


def _block_of(path: str, model_map: ModelMap) -> tuple[int, str] | None:
    for b in model_map.blocks:
        if path == b.path or path.startswith(b.path + "."):
            return b.index, b.placement
    return None


def signature(event: Event, model_map: ModelMap) -> str:
    """The ADVICE key for `event`."""
    d = event.details
    if event.kind == "drift":
        family = d.get("family")
        if family == "residual":
            block = _block_of(event.where[4:].rsplit("/", 1)[0], model_map)
            return "residual_growth_post" if block and block[1] == "post" else "residual_growth_pre"
        return "logz_drift" if family == "logz" else "attn_logit_growth"
    if event.kind == "spike":
        name = event.where
        if name.startswith("update/"):
            return "update_spike"
        if name.startswith("grad/"):
            block = _block_of(name[5:].rsplit("/", 1)[0], model_map)
            early = block is not None and block[0] < max(1, len(model_map.blocks) // 2)
            return (
                "early_grad_blowup_post"
                if early and block is not None and block[1] == "post"
                else "grad_spike"
            )
        return "loss_spike"
    return _nonfinite_signature(event, model_map)


def _nonfinite_signature(event: Event, model_map: ModelMap) -> str:
    pass_ = event.details.get("pass")
    if event.details.get("repeat") and pass_ in (None, "optimizer"):
        return "nonfinite_repeat"
    if pass_ is None:
        return "nonfinite_output" if event.where.startswith("logits/") else "nonfinite_unlocalized"
    if pass_ in ("input", "loss", "optimizer", "unknown"):
        return f"nonfinite_{pass_}"
    module = event.details.get("module", "")
    if _inside(module, model_map.attention_paths):
        return "nonfinite_attention"
    if module in ("", model_map.output_head):
        return "nonfinite_output"
    norms = [n.path for b in model_map.blocks for n in b.norms]
    if _inside(module, norms) or re.search(r"(^|\.)(ln|norm)[\w]*$", module):
        return "nonfinite_norm"
    return f"nonfinite_{pass_}" if pass_ in ("forward", "backward") else "nonfinite_forward"


def advise(event: Event, model_map: ModelMap) -> Event:
    """Fill `event.advice` and `details['advice', 'interventions']` from the table; returns the event."""
    key = signature(event, model_map)
    row = ADVICE[key]
    event.advice = f"{' or '.join(row.interventions)}: {row.text}" if row.interventions else row.text
    event.details["advice"] = key
    event.details["interventions"] = list(row.interventions)
    return event


def describe_advice() -> str:
    """The advice table as text (what `stabkit list advice` prints)."""
    width = max(len(k) for k in ADVICE)
    lines = [f"{'signature':<{width}}  {'interventions':<28}  when -> what to do"]
    for key, row in ADVICE.items():
        names = ", ".join(row.interventions) or "-"
        lines.append(f"{key:<{width}}  {names:<28}  {row.when} -> {row.text}")
    return "\n".join(lines)
