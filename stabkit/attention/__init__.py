"""Attention helpers shared by interventions and probes: a scoped function mode and math attention."""

from .math import (
    ScoreMod,
    SDPAArgs,
    attention_logits,
    causal_mask,
    expand_kv,
    math_attention,
    softcap_score_mod,
)
from .scope import SDPA, SOFTMAXES, ScopedFunctionMode, ScopeHandle, attach_scope

__all__ = [
    "SDPA",
    "SOFTMAXES",
    "SDPAArgs",
    "ScopeHandle",
    "ScopedFunctionMode",
    "ScoreMod",
    "attach_scope",
    "attention_logits",
    "causal_mask",
    "expand_kv",
    "math_attention",
    "softcap_score_mod",
]
