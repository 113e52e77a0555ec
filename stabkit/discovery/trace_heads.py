"""Which output features of which projection make each head's queries and keys, read from the traced
computation itself (autograd from the call's q and k back to the projection outputs).

Runs once, after `stabkit.discovery.trace.run_trace`. At sequence position 0 rotary embeddings are
the identity, so there the map from a projection's output features to (head, dim) of q is a plain
selection whatever the layout: concatenated ``[Q | K | V]``, interleaved per head (GPT-NeoX,
Bloom), grouped-query, or separate projections. One backward per head gives the features of that
head; a head whose features do not all carry the same coefficient (a norm or another mixing op
sits between the projection and the call) is reported as not a plain slice.

Queries or keys built from several projections (latent attention, MLA: each head's key is its own
"nope" part from ``kv_b_proj`` and a rotary part from ``kv_a_proj_with_mqa`` shared by every head)
are described part by part (`HeadPart`): for each projection, which head-dim positions it makes and,
per head, which of its output features make them. The positions are read with one backward per bit
of the head-dim index (a weight of 1 on the positions whose bit b is set tells each feature's bit b).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .roles import is_norm
from .trace import Projection, Trace


@dataclass
class HeadPart:
    """The head-dim positions of queries or keys that one projection makes."""

    projection: Projection
    dims: list[int]
    """Positions along the head dim this projection makes (sorted; the same for every head)."""
    columns: list[list[int]]
    """Per head (as the call sees the heads), the projection's output features making `dims`, in
    `dims` order."""

    @property
    def shared(self) -> bool:
        """Every head reads the same features (MLA's rotary key: one head broadcast to all)."""
        return len(self.columns) > 1 and all(c == self.columns[0] for c in self.columns)


@dataclass
class HeadSource:
    """Where the queries (or keys) of one attention call come from."""

    projection: Projection | None
    """The projection whose output feeds them (None when none or several do)."""
    columns: list[list[int]]
    """Per head (as the call sees the heads), the projection's output features, in head-dim order."""
    plain: bool
    """True when every head is a plain slice of the projection output (scaling allowed)."""
    normed_by: str | None = None
    """Path of a norm module between the projection and the call (the model's own QK-norm)."""
    reason: str = ""
    """Why `projection` is None or `plain` is False."""
    parts: list[HeadPart] = field(default_factory=list)
    """With several projections, each plain: one part per projection (empty otherwise)."""

    @property
    def distinct_heads(self) -> int:
        """Number of distinct feature sets (the true kv heads when the call sees repeated ones)."""
        return len({tuple(c) for c in self.columns})


def _grad(x: torch.Tensor, leaves: list[torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor | None]:
    """d(Σ weight·x)/d(leaves); a scalar output (an explicit grad_outputs imports a slow torch module)."""
    return list(torch.autograd.grad((x * weight).sum(), leaves, retain_graph=True, allow_unused=True))


def head_source(
    trace: Trace, x: torch.Tensor | None, before: int, modules: dict[str, nn.Module]
) -> HeadSource | None:
    """The source of `x` ((B, H, L, E) queries or keys at a call made at op index `before`).

    None when `x` cannot be followed (meta device, or it does not depend on any projection)."""
    try:
        return _head_source(trace, x, before, modules)
    except RuntimeError as exc:  # e.g. the forward modified a saved tensor in place
        return HeadSource(None, [], False, reason=f"q/k could not be followed back ({str(exc)[:80]})")


def _head_source(
    trace: Trace, x: torch.Tensor | None, before: int, modules: dict[str, nn.Module]
) -> HeadSource | None:
    if x is None or trace.device_type == "meta" or not x.requires_grad or x.dim() != 4:
        return None
    candidates = [p for p in trace.projections if p.index < before]
    if not candidates:
        return None
    leaves = [p.leaf for p in candidates]
    gen = torch.Generator().manual_seed(0)
    # random weights: a sum of a normalised head is constant, so all-ones weights can miss a dependence
    noise = (torch.rand(x.shape[1], x.shape[3], generator=gen) + 0.5).to(device=x.device, dtype=x.dtype)
    weight = torch.zeros_like(x)
    weight[0, :, 0, :] = noise
    used = [
        (p, g)
        for p, g in zip(candidates, _grad(x, leaves, weight))
        if g is not None and bool(g.abs().sum() > 0)
    ]
    if not used:
        return None
    if len(used) > 1:
        names = ", ".join(p.param for p, _ in used)
        source = HeadSource(None, [], False, reason=f"computed from several projections ({names})")
        source.parts = head_parts(x, [p for p, _ in used], noise) or []
        return source
    proj = used[0][0]
    heads, dim = x.shape[1], x.shape[3]
    columns: list[list[int]] = []
    plain = True
    for h in range(heads):
        weight.zero_()
        weight[0, h, 0, :] = noise[h]
        g = _grad(x, [proj.leaf], weight)[0]
        assert g is not None
        g2 = g.detach().reshape(-1, g.shape[-1]).float()  # (rows, features)
        rows = (g2.abs().sum(1) > 0).nonzero().flatten()
        cols = (g2.abs().sum(0) > 0).nonzero().flatten()
        weight[0, h, 0, :] = 1.0  # a plain slice (times a scale) passes a uniform weight on uniformly
        ones = _grad(x, [proj.leaf], weight)[0]
        assert ones is not None
        coef = ones.detach().reshape(-1, g.shape[-1]).float()[:, cols]
        coef = coef[coef != 0]
        if (
            len(rows) != 1
            or len(cols) != dim
            or len(coef) != dim
            or not torch.allclose(coef, coef[:1].expand_as(coef), rtol=1e-4)
        ):
            plain = False
        columns.append([int(c) for c in cols])
    source = HeadSource(proj, columns, plain)
    source.normed_by = _norm_between(trace, proj, x, before, modules)
    if not plain:
        source.reason = "the heads are not plain slices of the projection output" + (
            f" ({source.normed_by} normalises them)" if source.normed_by else ""
        )
    return source


def _norm_between(
    trace: Trace, proj: Projection, x: torch.Tensor, before: int, modules: dict[str, nn.Module]
) -> str | None:
    """Path of a norm module that ran between the projection and the call on the way to `x`."""
    upstream = trace.ancestors(id(x), since=proj.index)
    for call in trace.modules:
        if proj.index <= call.start and call.end <= before and call.output in upstream:
            module = modules.get(call.path)
            if module is not None and is_norm(module):
                return call.path
    return None


def head_parts(x: torch.Tensor, projections: list[Projection], noise: torch.Tensor) -> list[HeadPart] | None:
    """One `HeadPart` per projection of `projections` that `x` ((B, H, L, E) queries or keys) is made
    from, or None when some head is not a plain selection of their features (see the module
    docstring). `noise` (H, E): the random weights of `head_source`."""
    heads, dim = x.shape[1], x.shape[3]
    leaves = [p.leaf for p in projections]
    weight = torch.zeros_like(x)
    per_head: list[list[list[int]]] = [[] for _ in projections]  # projection -> head -> features
    for h in range(heads):
        weight.zero_()
        weight[0, h, 0, :] = noise[h]
        for i, g in enumerate(_grad(x, leaves, weight)):
            if g is None:
                per_head[i].append([])
                continue
            g2 = g.detach().reshape(-1, g.shape[-1]).float()
            if int((g2.abs().sum(1) > 0).sum()) > 1:
                return None  # a head reads more than one position's features
            per_head[i].append([int(c) for c in (g2.abs().sum(0) > 0).nonzero().flatten()])
        weight[0, h, 0, :] = 1.0  # a plain selection passes a uniform weight on uniformly
        for i, g in enumerate(_grad(x, leaves, weight)):
            if g is None or not per_head[i][h]:
                continue
            coef = g.detach().reshape(-1, g.shape[-1]).float()[:, per_head[i][h]]
            coef = coef[coef != 0]
            if len(coef) != len(per_head[i][h]) or not torch.allclose(
                coef, coef[:1].expand_as(coef), rtol=1e-4
            ):
                return None
    position: list[dict[int, int]] = [{} for _ in projections]  # feature -> head-dim position
    index = torch.arange(dim, device=x.device)
    for bit in range(max(1, (dim - 1).bit_length())):
        weight.zero_()
        weight[0, :, 0, :] = ((index >> bit) & 1).to(x.dtype)
        for i, g in enumerate(_grad(x, leaves, weight)):
            hit = (
                set()
                if g is None
                else set((g.detach().reshape(-1, g.shape[-1]).abs().sum(0) > 0).nonzero().flatten().tolist())
            )
            for cols in per_head[i]:
                for c in cols:
                    position[i][c] = position[i].get(c, 0) | ((1 << bit) if c in hit else 0)
    parts: list[HeadPart] = []
    covered: list[int] = []
    for i, proj in enumerate(projections):
        dims: list[int] | None = None
        columns: list[list[int]] = []
        for cols in per_head[i]:
            ordered = sorted(cols, key=lambda c: position[i][c])
            these = [position[i][c] for c in ordered]
            if len(set(these)) != len(these) or (dims is not None and these != dims):
                return None
            dims = these
            columns.append(ordered)
        if dims:
            parts.append(HeadPart(proj, dims, columns))
            covered += dims
    if sorted(covered) != list(range(dim)):
        return None  # a position made by two projections, or by none
    return parts
