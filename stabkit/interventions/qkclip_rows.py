"""Which weight rows ``qk_clip`` scales for each head, read from the discovered `AttentionMap`.

Runs once, at apply time. The result, per attention module, is a `ClipPlan`: the parameters that
make its queries and keys (weights and biases: a fused ``[Q|K|V]`` or per-head interleaved
projection, separate q/k projections, ``nn.MultiheadAttention``'s in-projection, projection ops on
weight parameters, the parts of latent attention), and for each of their output rows the *slot* of
the factor it is multiplied by at a clip (`SLOTS`): nothing, the query factor of head h, the full
factor of head h, or the key factor of kv head j.

K2's rule (arXiv 2507.20534, §2.1 / App. D), with γ_h = τ / S_h for a head whose max logit S_h
exceeds τ (else 1) and α = 0.5:

- a query head's rows take γ_h^α, its kv head's key rows Γ_j^(1−α), with Γ_j the smallest γ among
  the query heads that share kv head j (GQA: the group's max logit decides its keys);
- latent attention (MLA): a head's own "nope" query and key rows take √γ (α = 0.5), its rotary query
  rows the head's whole factor (γ_h without GQA), and the rotary key shared by every head is left
  alone — its query counterpart carries the factor instead (`QKPart.shared`).

So every logit of head h is multiplied by γ_h^α·Γ_j^(1−α) — exactly γ_h (τ / S_h) for a head whose
own max decides its kv head, e.g. every head without GQA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..discovery.roles import out_features
from .handle import InterventionError

NAME = "qk_clip"

KEEP, QUERY, FULL, KEY = range(4)
"""Kinds of slot: a row not scaled; a query row (γ_h^α); a query row against a shared key (the
head's whole factor); a key row (Γ_j^(1−α))."""


@dataclass
class RowTarget:
    """The rows of one parameter that a clip scales."""

    name: str
    """Parameter name (``named_parameters``)."""
    param: nn.Parameter
    axis: int
    """The axis indexing output features (nn.Linear weight: 0; HF Conv1D weight: 1; a bias: 0)."""
    slots: list[int] = field(default_factory=list)
    """Per output row: its index into the module's factor table (0: unscaled; see `ClipPlan.table`)."""


@dataclass
class ClipPlan:
    """What one attention module's clip touches."""

    path: str
    n_heads: int
    kv_of_head: list[int]
    """Per query head, the index of the kv head whose key rows it shares."""
    targets: dict[str, RowTarget] = field(default_factory=dict)
    _kv: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def n_kv(self) -> int:
        return max(self.kv_of_head) + 1 if self.kv_of_head else 0

    def slot(self, kind: int, index: int) -> int:
        """Index into the factor table of (`kind`, head or kv head `index`)."""
        h = self.n_heads
        return {KEEP: 0, QUERY: 1 + index, FULL: 1 + h + index, KEY: 1 + 2 * h + index}[kind]

    def table(self, gamma: torch.Tensor, alpha: float) -> torch.Tensor:
        """(1 + 2H + Hkv,) factors from (H,) per-head γ: [1, γ_h^α, γ_h^α·Γ_j^(1−α), Γ_j^(1−α)]."""
        kv = self._kv.get(gamma.device)
        if kv is None:
            kv = self._kv[gamma.device] = torch.tensor(self.kv_of_head, device=gamma.device)
        group = torch.ones(self.n_kv, device=gamma.device).scatter_reduce(0, kv, gamma, "amin")  # Γ_j
        query = gamma.pow(alpha)
        key = group.pow(1.0 - alpha)
        return torch.cat([gamma.new_ones(1), query, query * key.index_select(0, kv), key])

    def mark(
        self, model: nn.Module, source: str, weight: bool, axis: int | None, rows: list[int], slot: int
    ) -> None:
        """Scale `rows` of projection `source` (a module path, or a parameter name when `weight`)
        by factor `slot`: its weight, and its bias when it has one."""
        for target in _targets(model, self, source, weight, axis):
            size = target.param.shape[target.axis]
            if not target.slots:
                target.slots = [0] * size
            for r in rows:
                if r >= size:
                    raise InterventionError(NAME, self.path, f"row {r} is past {target.name} ({size} rows)")
                if target.slots[r] not in (0, slot):
                    raise InterventionError(NAME, self.path, f"row {r} of {target.name} makes two heads")
                target.slots[r] = slot


def _targets(
    model: nn.Module, plan: ClipPlan, source: str, weight: bool, axis: int | None
) -> list[RowTarget]:
    """The parameters whose rows make the output features of `source` (created once per parameter)."""
    found: list[tuple[str, nn.Parameter, int]] = []
    if weight:
        param = _parameter(model, plan.path, source)
        if axis is None:
            raise InterventionError(
                NAME,
                plan.path,
                f"cannot tell which axis of {source} indexes the projection's output features "
                "(a transposed or reshaped weight); QK-Clip needs F.linear, x @ W or an einsum on the parameter",
            )
        found.append((source, param, axis % param.dim()))
    else:
        module = model.get_submodule(source)
        w = getattr(module, "weight", None)
        width = out_features(module)
        if not isinstance(w, nn.Parameter) or w.dim() != 2 or width is None:
            raise InterventionError(
                NAME,
                source,
                f"{type(module).__name__} is not a linear projection stabkit can scale row by row",
            )
        found.append(
            (f"{source}.weight", w, 0 if w.shape[0] == width and isinstance(module, nn.Linear) else 1)
        )
        b = getattr(module, "bias", None)
        if isinstance(b, nn.Parameter):
            found.append((f"{source}.bias", b, 0))
    out = []
    for name, param, ax in found:
        target = plan.targets.get(name)
        if target is None:
            target = plan.targets[name] = RowTarget(name, param, ax)
        out.append(target)
    return out


def _parameter(model: nn.Module, path: str, name: str) -> nn.Parameter:
    try:
        return model.get_parameter(name)
    except AttributeError as exc:
        raise InterventionError(NAME, path, f"projection weight {name!r} not found") from exc


def _kv_map(n_heads: int, columns: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """(kv index of each query head, the distinct key column sets) from the key heads the call sees
    (GQA: fewer than the query heads, each shared by a consecutive group; or repeated per query head)."""
    distinct: list[tuple[int, ...]] = list(dict.fromkeys(tuple(c) for c in columns))
    group = max(1, n_heads // max(1, len(columns)))
    kv = [distinct.index(tuple(columns[min(h // group, len(columns) - 1)])) for h in range(n_heads)]
    return kv, [list(c) for c in distinct]


def plan_for(model: nn.Module, a: Any) -> ClipPlan:
    """The `ClipPlan` of attention module `a` (an `AttentionMap`); InterventionError naming what is
    missing when QK-Clip cannot act on it."""
    if not a.n_heads:
        raise InterventionError(NAME, a.path, "the number of heads is unknown (pass model_map= with it)")
    if a.qk_norm:
        raise InterventionError(
            NAME,
            a.path,
            f"its queries and keys are normalised ({a.qk_norm}) after their projections: scaling W_q and "
            "W_k does not change its logits (the norm's gains bound them)",
        )
    attn = model.get_submodule(a.path) if a.path else model
    heads = int(a.n_heads)
    if isinstance(attn, nn.MultiheadAttention):
        return _mha_plan(a, attn, heads)
    if a.q_parts and a.k_parts:
        return _parts_plan(model, a, heads)
    q_columns, k_columns = a.q_columns, a.k_columns
    if q_columns is None and a.found != "traced" and not a.qk_note:
        q_columns, k_columns = _named_columns(a)
    if a.qk_mixed or q_columns is None or k_columns is None:
        why = a.qk_note or "q/k could not be followed back to their projections"
        raise InterventionError(NAME, a.path, f"q/k rows unknown: {why}")
    kv, keys = _kv_map(heads, k_columns)
    plan = ClipPlan(a.path, heads, kv)
    if a.qkv:
        q_src, k_src, weight, q_axis, k_axis = a.qkv, a.qkv, False, None, None
    elif a.q and a.k:
        q_src, k_src, weight, q_axis, k_axis = a.q, a.k, False, None, None
    elif a.q_weight and a.k_weight:
        q_src, k_src, weight, q_axis, k_axis = a.q_weight, a.k_weight, True, a.q_weight_axis, a.k_weight_axis
    else:
        raise InterventionError(NAME, a.path, "no q/k projection found")
    for h, cols in enumerate(q_columns):
        plan.mark(model, q_src, weight, q_axis, cols, plan.slot(QUERY, h))
    for j, cols in enumerate(keys):
        plan.mark(model, k_src, weight, k_axis, cols, plan.slot(KEY, j))
    return plan


def _named_columns(a: Any) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """Rows per head of a map found by module names (a family stabkit knows by class, e.g. on the
    meta device): contiguous heads of separate q/k projections, or of a fused ``[Q | K | V]``."""
    hd, heads = a.head_dim, a.n_heads
    kv = a.n_kv_heads or heads
    if not hd or not heads:
        return None, None
    offset = 0
    if a.qkv and a.qkv_layout == "q|k|v":
        offset = heads * hd
    elif not (a.q and a.k):
        return None, None
    q = [list(range(h * hd, (h + 1) * hd)) for h in range(heads)]
    k = [list(range(offset + j * hd, offset + (j + 1) * hd)) for j in range(kv)]
    return q, k


def _parts_plan(model: nn.Module, a: Any, heads: int) -> ClipPlan:
    """Latent attention (MLA): q and k by part (`AttentionMap.q_parts` / `k_parts`)."""
    own = [p for p in a.k_parts if not p.shared]
    kv, _ = _kv_map(heads, own[0].columns) if own else (list(range(heads)), [])
    plan = ClipPlan(a.path, heads, kv)
    for part in a.q_parts:
        against = next((k for k in a.k_parts if set(part.dims) <= set(k.dims)), None)
        if against is None:
            raise InterventionError(NAME, a.path, "a query part meets no single key part")
        kind = FULL if against.shared else QUERY
        for h, cols in enumerate(part.columns):
            plan.mark(model, part.source, part.weight, part.axis, cols, plan.slot(kind, h))
    for part in own:
        _, distinct = _kv_map(heads, part.columns)
        for j, cols in enumerate(distinct):
            plan.mark(model, part.source, part.weight, part.axis, cols, plan.slot(KEY, j))
    return plan


def _mha_plan(a: Any, attn: nn.MultiheadAttention, heads: int) -> ClipPlan:
    """``nn.MultiheadAttention``: rows [0, E) of the in-projection are q, [E, 2E) k (or separate
    q/k projection weights), head h the rows [h·hd, (h+1)·hd) of each; ``in_proj_bias`` likewise."""
    embed, hd = attn.embed_dim, attn.head_dim
    plan = ClipPlan(a.path, heads, list(range(heads)))
    prefix = f"{a.path}." if a.path else ""

    def add(name: str, param: nn.Parameter | None, offset: int) -> None:
        if param is None:
            return
        target = plan.targets.setdefault(
            prefix + name, RowTarget(prefix + name, param, 0, [0] * param.shape[0])
        )
        for h in range(heads):
            kind = QUERY if offset == 0 else KEY
            for r in range(h * hd, (h + 1) * hd):
                target.slots[offset + r] = plan.slot(kind, h)

    if attn._qkv_same_embed_dim:
        add("in_proj_weight", attn.in_proj_weight, 0)
        add("in_proj_weight", attn.in_proj_weight, embed)
    else:
        add("q_proj_weight", attn.q_proj_weight, 0)
        add("k_proj_weight", attn.k_proj_weight, 0)
        plan.targets[prefix + "k_proj_weight"].slots = [
            plan.slot(KEY, r // hd) for r in range(attn.k_proj_weight.shape[0])
        ]
    add("in_proj_bias", attn.in_proj_bias, 0)
    add("in_proj_bias", attn.in_proj_bias, embed)
    return plan
