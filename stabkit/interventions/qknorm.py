"""QK-norm: normalise each head's query and key (RMSNorm or LayerNorm over head_dim, learnable gain
initialised to 1, shared by the heads) before the dot product, and before RoPE where the family
applies RoPE after the projections (HF LLaMA-family, the stabkit reference GPT).

With it, ``|logit| = scale·|⟨g_q⊙q̂, g_k⊙k̂⟩| ≤ scale·head_dim·max|g_q|·max|g_k|`` (q̂, k̂ have norm at
most √head_dim), so attention logits cannot grow without the gains growing (`qk_norm_logit_bound`).

Routes, chosen at apply time from the ModelMap:

- stabkit reference GPT: its own ``q_norm``/``k_norm`` slots (state_dict keys as ``GPTConfig(qk_norm=True)``);
- fused qkv (HF GPT-2 ``Conv1D c_attn``, nanoGPT ``nn.Linear c_attn``): a forward hook on the projection
  that normalises the q and k slices per head;
- separate q/k projections (HF LLaMA-family): forward hooks on ``q_proj`` and ``k_proj`` outputs;
- ``nn.MultiheadAttention``: the decomposed forward of `stabkit.interventions.mha`.

The gains live in a ``stabkit_qk_norm`` submodule (``.q.weight``, ``.k.weight``) of each attention module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..discovery.roles import out_features
from ..distributed.context import is_dtensor
from ..hooks import DIRECT
from ..plugins import INTERVENTIONS
from ..tables import bounds
from .base import Intervention, choices
from .common import QK_NORM_ATTR, add_module, keep_hook, model_map, norm_eps, swap_module
from .handle import Handle, InterventionError
from .mha import patch_mha
from .qknorm_routes import hook_at_call, hook_weight_ops, normalise_columns
from .verify import check_qk_norm

if TYPE_CHECKING:
    from ..discovery.trace import Trace

NAME = "qk_norm"
NORM_KINDS = ("rmsnorm", "layernorm")


class HeadNorm(nn.Module):
    """Normalises a (..., H·head_dim) tensor per head over head_dim; one gain (head_dim,) for all heads."""

    def __init__(self, head_dim: int, kind: str = "rmsnorm", eps: float = 1e-6) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.kind = kind
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, self.head_dim))  # (..., H, hd)
        shape = (self.head_dim,)
        if self.kind == "rmsnorm":
            y = F.rms_norm(heads, shape, self.weight, self.eps)
        else:
            y = F.layer_norm(heads, shape, self.weight, None, self.eps)
        return y.flatten(-2)  # (..., H·hd)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, kind={self.kind}, eps={self.eps}"


class QKNorm(nn.Module):
    """The query and key `HeadNorm` of one attention module."""

    def __init__(self, head_dim: int, kind: str, eps: float) -> None:
        super().__init__()
        self.q = HeadNorm(head_dim, kind, eps)
        self.k = HeadNorm(head_dim, kind, eps)


def _eps(model: nn.Module, block_norms: list[Any], eps: float | None) -> float:
    if eps is not None:
        return float(eps)
    if block_norms:
        return norm_eps(model.get_submodule(block_norms[0].path))
    return 1e-6


def _refuse_if_sharded(model: nn.Module) -> None:
    """QK-norm adds parameters (the gains): on a model whose parameters are already DTensors no
    parallel wrapper reduces their gradients, so every rank would train its own gains (under tensor
    parallelism each from its own heads only)."""
    sharded = next((n for n, p in model.named_parameters() if is_dtensor(p)), None)
    if sharded is not None:
        raise InterventionError(
            NAME,
            type(model).__name__,
            f"its parameters are already sharded DTensors ({sharded}: FSDP2 or tensor parallel), and the "
            "gains QK-norm adds would be plain parameters whose gradients no rank reduces. Under FSDP2 "
            "alone, apply it before sharding: stabkit.interventions.apply(model, 'qk_norm'), then "
            "fully_shard, then attach. Under tensor parallelism, put the q/k norms in the model's code with "
            "an entry in the TP plan (as torchtitan's Qwen3 does) instead",
        )


def apply_qk_norm(
    model: nn.Module, kind: str = "rmsnorm", eps: float | None = None, model_map_override: Any = None
) -> Handle:
    """Add per-head QK-norm to every attention module of `model` (see the module docstring).

    ``eps`` defaults to the epsilon of the block's own norms (1e-6 when it has none).
    """
    from ..discovery.families import STABKIT_GPT, declared_family

    if kind not in NORM_KINDS:
        raise InterventionError(NAME, "", f"kind must be one of {NORM_KINDS}, got {kind!r}")
    if eps is not None and not (isinstance(eps, float | int) and eps > 0):
        raise InterventionError(
            NAME, "", f"eps must be None (the block norms' eps) or a positive number, got {eps!r}"
        )
    _refuse_if_sharded(model)
    mmap = model_map(model, NAME, model_map_override)
    handle = Handle(model, [NAME])
    try:
        for a in {a.path: a for a in mmap.attentions}.values():
            attn = model.get_submodule(a.path)
            _refuse_if_normed(a, attn)
            if not a.head_dim or not a.n_heads:
                raise InterventionError(
                    NAME, a.path, "head_dim / n_heads unknown (pass model_map= with them)"
                )
            hd, heads, kv_heads = a.head_dim, a.n_heads, a.n_kv_heads or a.n_heads
            ref = next(iter(attn.parameters()), None)
            ref = ref if ref is not None else next(model.parameters())
            block = mmap.block_of(a.path)
            block_norms = next((b.norms for b in mmap.blocks if b.path == block), [])
            norms = QKNorm(hd, kind, _eps(model, block_norms, eps)).to(device=ref.device, dtype=ref.dtype)
            if declared_family(attn) == STABKIT_GPT:  # the reference GPT: fill its q_norm/k_norm slots
                swap_module(handle, attn, "q_norm", norms.q)
                swap_module(handle, attn, "k_norm", norms.k)
                handle.add_parameters(norms.parameters())
                continue
            if isinstance(attn, nn.MultiheadAttention):
                add_module(handle, NAME, attn, a.path, QK_NORM_ATTR, norms)
                patch_mha(handle, model, a.path, NAME)
            elif (
                a.q_columns is not None
                and a.k_columns is not None
                and not a.qk_note
                and (a.qkv or (a.q and a.k))
            ):
                _hook_traced(handle, model, a, norms)
            elif a.q_weight and a.k_weight and a.q_columns is not None and a.k_columns is not None:
                _own(handle, model, a, norms)
                hook_weight_ops(handle, model, a, norms.q, norms.k, NAME)
            elif a.found == "traced" and not a.qk_mixed and _at_call(a.impl):
                _own(handle, model, a, norms)
                hook_at_call(handle, model, a, norms.q, norms.k, NAME)
            elif a.qk_note:
                raise InterventionError(NAME, a.path, f"q/k rows unknown: {a.qk_note}")
            elif a.qkv:
                add_module(handle, NAME, attn, a.path, QK_NORM_ATTR, norms)
                _hook_fused(handle, model, a.qkv, norms, hd * heads, hd * kv_heads)
            elif a.q and a.k:
                add_module(handle, NAME, attn, a.path, QK_NORM_ATTR, norms)
                keep_hook(handle, model.get_submodule(a.q).register_forward_hook(_hook_on(norms.q)))
                keep_hook(handle, model.get_submodule(a.k).register_forward_hook(_hook_on(norms.k)))
            else:
                raise InterventionError(NAME, a.path, "no q/k projections or fused qkv projection found")
    except BaseException:
        handle.remove()
        raise
    return handle


def _at_call(impl: str) -> bool:
    """Attention whose q and k can be normalised at the call: SDPA, eager q·kᵀ, a known kernel."""
    return impl in ("sdpa", "eager") or impl.startswith("kernel:")


def _own(handle: Handle, model: nn.Module, a: Any, norms: QKNorm) -> None:
    """Register the gains under the attention module (the root when attention is computed there)."""
    owner = model.get_submodule(a.path) if a.path else model
    add_module(handle, NAME, owner, a.path or type(model).__name__, QK_NORM_ATTR, norms)


def _refuse_if_normed(a: Any, attn: nn.Module) -> None:
    """Refuse attention that normalises q/k already (traced, or a q_norm/k_norm slot that is a norm)."""
    if a.qk_norm:
        raise InterventionError(NAME, a.path, f"it already has QK-norm ({a.qk_norm})")
    for attr in ("q_norm", "k_norm", QK_NORM_ATTR):
        slot = getattr(attn, attr, None)
        if slot is not None and not isinstance(slot, nn.Identity):
            raise InterventionError(NAME, a.path, f"it already has QK-norm ({attr})")


def _hook_traced(handle: Handle, model: nn.Module, a: Any, norms: QKNorm) -> None:
    """Normalise the traced q and k features per head on their projections' outputs (any layout:
    concatenated, interleaved per head, GQA, separate projections)."""
    if a.qk_note or not (a.qkv or (a.q and a.k)):
        raise InterventionError(NAME, a.path, f"q/k rows unknown: {a.qk_note or 'no projection module'}")
    attn = model.get_submodule(a.path)
    owner, owner_path = (attn, a.path) if a.path else (model, "")
    add_module(handle, NAME, owner, owner_path or type(model).__name__, QK_NORM_ATTR, norms)
    q_idx = [c for head in a.q_columns for c in head]  # head-major, head-dim order
    k_idx = [c for head in a.k_columns for c in head]
    if a.qkv:
        pairs = [(norms.q, q_idx), (norms.k, k_idx)]
        keep_hook(handle, model.get_submodule(a.qkv).register_forward_hook(_columns_hook(pairs)))
    else:
        keep_hook(handle, model.get_submodule(a.q).register_forward_hook(_columns_hook([(norms.q, q_idx)])))
        keep_hook(handle, model.get_submodule(a.k).register_forward_hook(_columns_hook([(norms.k, k_idx)])))


def _columns_hook(pairs: list[tuple[HeadNorm, list[int]]]) -> Any:
    """A forward hook normalising, per head, the given output features of a projection."""
    cache: dict[torch.device, list[torch.Tensor]] = {}

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        index = cache.get(out.device)
        if index is None:
            index = cache[out.device] = [torch.tensor(i, device=out.device) for _, i in pairs]
        y = out
        for (norm, cols), idx in zip(pairs, index):
            y = normalise_columns(y, norm, cols, idx)
        return y

    return hook


def _hook_on(norm: HeadNorm) -> Any:
    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return norm(out)  # (B, T, H·hd)

    return hook


def _hook_fused(
    handle: Handle, model: nn.Module, path: str, norms: QKNorm, q_width: int, k_width: int
) -> None:
    """Normalise the q and k slices of a fused [q | k | v] projection output."""
    proj = model.get_submodule(path)
    width = out_features(proj)
    if width is None or width != q_width + 2 * k_width:
        raise InterventionError(
            NAME, path, f"fused projection width {width} is not q {q_width} + k {k_width} + v {k_width}"
        )

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        q, k, v = out.split([q_width, k_width, k_width], dim=-1)  # (B, T, H·hd), (B, T, Hkv·hd) ×2
        return torch.cat([norms.q(q), norms.k(k), v], dim=-1)

    keep_hook(handle, proj.register_forward_hook(hook))


def _vector_bound(norm: nn.Module, head_dim: int) -> torch.Tensor:
    """Largest possible ‖norm(x)‖ over one head: max|g|·√hd (+ ‖b‖ with a bias)."""
    weight = getattr(norm, "weight", None)
    gain = weight.detach().abs().max() if weight is not None else torch.tensor(1.0)
    bound = gain * head_dim**0.5
    bias = getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        bound = bound + bias.detach().norm()
    return bound


def qk_norm_logit_bounds(model: nn.Module) -> dict[str, float]:
    """Per attention module with QK-norm: ``scale · max‖ĝ_q q̂‖ · max‖ĝ_k k̂‖`` from the current gains
    (= scale·head_dim·max|g_q|·max|g_k| without biases), an upper bound on |attention logit|.

    Call between steps; reads parameter values (one host sync per module).
    """
    out: dict[str, float] = {}
    for path, attn in model.named_modules():
        container = attn._modules.get(QK_NORM_ATTR)
        if container is not None:
            q_norm, k_norm = container.q, container.k
        elif isinstance(getattr(attn, "q_norm", None), nn.Module) and isinstance(
            getattr(attn, "k_norm", None), nn.Module
        ):
            q_norm, k_norm = attn.q_norm, attn.k_norm
        else:
            continue
        head_dim = int(getattr(q_norm, "head_dim", 0) or q_norm.weight.shape[-1])
        scale = getattr(attn, "scaling", None)
        scale = float(scale) if isinstance(scale, float | int) else head_dim**-0.5
        bound = scale * _vector_bound(q_norm, head_dim) * _vector_bound(k_norm, head_dim)
        out[path] = float(bound)  # sync point
    return out


def qk_norm_logit_bound(model: nn.Module) -> float:
    """The largest of `qk_norm_logit_bounds`; raises InterventionError when no attention has QK-norm."""
    bounds = qk_norm_logit_bounds(model)
    if not bounds:
        raise InterventionError(NAME, type(model).__name__, "no attention module with QK-norm found")
    return max(bounds.values())


@dataclass(frozen=True)
class QKNormOptions:
    """The options of ``qk_norm``."""

    kind: str = field(default="rmsnorm", metadata=choices(*NORM_KINDS))
    """The per-head norm: 'rmsnorm' or 'layernorm' (gain only)."""
    eps: float | None = field(default=None, metadata=bounds(lo=0.0, lo_open=True, hint="or None"))
    """The norm's epsilon; None: the epsilon of the block's own norms (1e-6 when it has none)."""


@INTERVENTIONS.register
class QKNormIntervention(Intervention):
    """``qk_norm``: per-head norm of queries and keys (attention: after norm surgery, before the caps).

    At a mid-run switch its gains start at each norm's mean RMS of the q or k it normalises
    (`match_at_switch`), so ``γ·q/rms(q) ≈ q`` on average."""

    name = NAME
    order = 30
    description = "per-head norm of queries and keys (learnable gain, before RoPE) to bound attention logits"
    options_class = QKNormOptions
    midrun = True
    midrun_preference = 10

    def apply(self, model: nn.Module, model_map: Any, options: QKNormOptions) -> Handle:
        return apply_qk_norm(model, options.kind, options.eps, model_map)

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        check_qk_norm(trace)

    def match_at_switch(self, model: nn.Module, handle: Handle, rerun: Callable[[], Any]) -> None:
        """Set each HeadNorm's gain to the mean RMS (over tokens and heads) of the q or k it
        normalises on the rerun forwards, so the normalised q and k keep their scale."""
        norms = [m for m in model.modules() if isinstance(m, HeadNorm)]
        sums: dict[int, list[float]] = {id(m): [0.0, 0.0] for m in norms}

        def measure(module: HeadNorm, args: tuple[Any, ...]) -> None:
            x = args[0].detach().float().unflatten(-1, (-1, module.head_dim))  # (..., H, hd)
            entry = sums[id(module)]
            entry[0] += float(x.pow(2).mean(-1).sqrt().sum())  # sync point (once per rescue)
            entry[1] += x[..., 0].numel()

        hooks = [DIRECT.forward_pre(NAME, m, measure) for m in norms]
        try:
            rerun()
        finally:
            for h in hooks:
                h.remove()
        with torch.no_grad():
            for m in norms:
                total, count = sums[id(m)]
                if count:
                    m.weight.fill_(total / count)
