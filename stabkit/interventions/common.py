"""Reversible surgery primitives shared by the interventions: attribute and module swaps, hooks, norms.

All of these run at ``apply`` time and register their own undo step on the handle, so an
intervention is a sequence of primitive edits and ``Handle.remove()`` replays them backwards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..discovery import DiscoveryError, LogitsMap, ModelMap, inspect_model
from ..discovery.modelmap import OPAQUE
from ..layers import RMSNorm
from .handle import Handle, InterventionError

_MISSING = object()
QK_NORM_ATTR = "stabkit_qk_norm"
"""Submodule name under an attention module holding the QK-norm gains added by ``qk_norm`` (``.q``, ``.k``)."""


NEEDS_TRACE = ("qk_norm", "attn_softcap", "norm_placement", "qk_clip")
KNOWN_FAMILIES = ("stabkit-gpt", "torch-encoder", "hf-gpt2", "hf-llama", "nanogpt")
"""Families whose roles stabkit knows by class and layout, not by guessing from names: a map by names
of these (a model on the meta device, FSDP2-sharded) is trusted."""
"""Interventions that act on every attention call: module names alone may miss some."""
TRACE_HINT = (
    "stabkit could not trace a forward of this model (it cannot make an input for it, or its parameters "
    "are sharded DTensors: FSDP2, tensor parallel), and module names alone can miss attention calls or "
    "take the wrong module; pass example=<a batch> to apply, or (sharded) model_map= naming the roles"
)


def model_map(model: nn.Module, name: str, override: dict[str, Any] | ModelMap | None = None) -> ModelMap:
    """Discover the roles of `model` (or check `override`), naming `name` in any error. Without an
    override, an intervention on attention refuses a map made from names only, or attention
    computed where stabkit cannot see it (its effect could not be checked)."""
    try:
        mmap = inspect_model(model, override)
    except DiscoveryError as exc:
        raise InterventionError(name, type(model).__name__, str(exc)) from exc
    if override is None and name in NEEDS_TRACE:
        opaque = [a.path for a in mmap.attentions if a.impl == OPAQUE]
        if opaque:
            raise InterventionError(
                name,
                opaque[0],
                "its attention runs in a kernel stabkit cannot see (register it with "
                "stabkit.register_kernel), so the change could not be placed or checked",
            )
        if (mmap.found.get("attention") == "named" and mmap.family not in KNOWN_FAMILIES) or not mmap.blocks:
            impls = sorted({a.impl for a in mmap.attentions})
            raise InterventionError(
                name, type(model).__name__, f"{TRACE_HINT} (attention: {', '.join(impls)})"
            )
    return mmap


def logits_map(model: nn.Module, name: str, override: dict[str, Any] | ModelMap | None = None) -> LogitsMap:
    """Where the final logits of `model` are; needs no attention discovery (z_loss, logit_softcap)."""
    mmap: ModelMap | None
    try:
        mmap = inspect_model(model, override)
    except DiscoveryError:
        from ..discovery.discover import logits_only

        mmap = logits_only(model)
    if mmap is None or mmap.logits is None:
        raise InterventionError(
            name,
            type(model).__name__,
            "no final logits found: the model's output is not computed by a projection after its last "
            "block (pass model_map= with output_head)",
        )
    if override is None and mmap.logits.found == "named" and mmap.family not in KNOWN_FAMILIES:
        raise InterventionError(name, type(model).__name__, TRACE_HINT)
    return mmap.logits


def warn_internal_loss(name: str, path: str, output: Any, said: set[int]) -> None:
    """Warn once per model output type and application (`said`, kept by the intervention's hook) when
    the model computed its own loss *before* the logits were changed on its output: that loss does
    not see the change (compute it from the returned logits). Runs in the intervention's forward hook."""
    loss = getattr(output, "loss", None)
    if path == "" and isinstance(loss, torch.Tensor) and id(type(output)) not in said:
        said.add(id(type(output)))
        import warnings

        warnings.warn(
            f"stabkit: {name} acts on the model's returned logits, but the model computed `loss` inside "
            "forward from logits scaled or capped after its head; that loss does not include it. "
            "Compute the loss from outputs.logits (or add stabkit.z_loss(logits) yourself)",
            RuntimeWarning,
            stacklevel=2,
        )


def parent_of(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The parent module of `path` and the attribute name under it."""
    parent, _, leaf = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def swap_module(handle: Handle, parent: nn.Module, name: str, new: nn.Module | None) -> None:
    """``parent.<name> = new`` (module or None), restored exactly on remove (same slot, same order).

    A slot that existed is restored only while it still holds `new`; a slot created here is deleted
    whatever it holds by then. So handles removed out of order (a module added by one intervention
    and swapped by another) never resurrect a removed module."""
    if name in parent._modules:
        old = parent._modules[name]
        setattr(parent, name, new)

        def undo() -> None:
            if name in parent._modules and parent._modules[name] is new:  # untouched since: restore
                parent._modules[name] = old  # keeps the key's position, so named_modules order is unchanged

    else:
        old_plain = parent.__dict__.get(name, _MISSING)
        if old_plain is not _MISSING and old_plain is not None:
            raise TypeError(
                f"{type(parent).__name__}.{name} is a plain attribute ({old_plain!r}), not a module slot"
            )
        if new is None:
            raise ValueError("swap_module cannot create an empty slot")
        setattr(parent, name, new)  # nn.Module moves a plain `None` attribute into _modules

        def undo() -> None:
            parent._modules.pop(name, None)  # the slot is ours, whatever was swapped into it since
            if old_plain is not _MISSING:
                parent.__dict__[name] = old_plain

    handle.on_remove(undo)


def add_module(
    handle: Handle, intervention: str, parent: nn.Module, parent_path: str, name: str, new: nn.Module
) -> None:
    """Register a new submodule ``parent.<name>``; refuses to overwrite anything."""
    if hasattr(parent, name):
        raise InterventionError(
            intervention,
            parent_path,
            f"attribute {name!r} already exists (is the intervention applied already?)",
        )
    swap_module(handle, parent, name, new)
    handle.add_parameters(new.parameters())


def set_attr(handle: Handle, obj: Any, name: str, value: Any) -> None:
    """``obj.<name> = value`` for a plain (non-module) attribute, restored (or deleted) on remove."""
    old = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)

    def undo() -> None:
        if old is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = old

    handle.on_remove(undo)


def keep_hook(handle: Handle, removable: Any) -> None:
    """Remove a hook handle (``torch.utils.hooks.RemovableHandle`` or ScopeHandle) on remove."""
    handle.on_remove(removable.remove)


def map_first(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to a module output that is a tensor or a tuple whose first item is the tensor."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    raise TypeError(f"expected a tensor or a tuple starting with a tensor, got {type(output).__name__}")


def norm_eps(norm: nn.Module, default: float = 1e-6) -> float:
    """Epsilon of a LayerNorm / RMSNorm-like module (``eps`` or HF's ``variance_epsilon``)."""
    for attr in ("eps", "variance_epsilon", "epsilon", "layer_norm_eps"):
        value = getattr(norm, attr, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return default


_GAINS = ("weight", "gain", "scale", "gamma", "g", "bias", "beta")
"""Attributes whose last dim is a norm's width: its gain (or its bias, for a norm without a gain)."""
_WIDTHS = ("hidden_size", "d_model", "n_embd", "embed_dim", "num_features", "normalized_dim")
"""Integer attributes that hold a norm's width, in classes that keep neither shape nor gain."""


def norm_width(norm: nn.Module, intervention: str = "norm", path: str = "") -> int:
    """Number of features a norm normalises: the last entry of its ``normalized_shape``, else the last
    dim of its gain or bias (``weight``/``bias``, also ``gain``/``scale``/``gamma``/``g``/``beta``;
    nanoGPT's own LayerNorm class keeps only those), else an integer width attribute (``hidden_size``,
    ...). Raises InterventionError naming `intervention` and `path` when nothing tells it."""
    shape = getattr(norm, "normalized_shape", None)
    if isinstance(shape, int) and not isinstance(shape, bool) and shape > 0:
        return shape
    if isinstance(shape, tuple | list | torch.Size) and shape:
        last = shape[-1]
        if isinstance(last, int) and not isinstance(last, bool) and last > 0:
            return last
    for attr in _GAINS:
        value = getattr(norm, attr, None)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] > 0:
            return int(value.shape[-1])
    for attr in _WIDTHS:
        value = getattr(norm, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise InterventionError(
        intervention,
        path or type(norm).__name__,
        f"cannot tell the width of {type(norm).__name__}: it has no normalized_shape, no gain or bias "
        "parameter (weight, bias) and no width attribute (hidden_size, ...)",
    )


def _like(module: nn.Module) -> dict[str, Any]:
    ref = next(iter(module.parameters()), None)
    return {} if ref is None else {"device": ref.device, "dtype": ref.dtype}


def norm_like(intervention: str, norm: nn.Module, path: str, dim: int) -> nn.Module:
    """A fresh norm of the same kind as `norm` over `dim` features, gain 1 and bias 0: a LayerNorm or
    RMSNorm built anew, any other norm class (HF CohereLayerNorm, T5LayerNorm, nanoGPT's LayerNorm, ...)
    copied and reset. Raises InterventionError (naming `intervention` and `path`) when the class has
    no gain of width `dim` to reset or its copy cannot be run."""
    if isinstance(norm, nn.LayerNorm) and type(norm).forward is nn.LayerNorm.forward:
        new: nn.Module = nn.LayerNorm(
            dim, eps=norm.eps, elementwise_affine=norm.elementwise_affine, bias=norm.bias is not None
        )
    elif isinstance(norm, nn.RMSNorm) and type(norm).forward is nn.RMSNorm.forward:
        new = nn.RMSNorm(dim, eps=norm.eps, elementwise_affine=norm.elementwise_affine)
    elif type(norm).__name__ == "RMSNorm" and norm_width(norm, intervention, path) == dim:
        new = RMSNorm(dim, eps=norm_eps(norm))
    else:
        new = copy.deepcopy(norm)
        weight, bias = getattr(new, "weight", None), getattr(new, "bias", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 1 or weight.shape[-1] != dim:
            raise InterventionError(
                intervention, path, f"norm of type {type(norm).__name__} has no gain of width {dim} to reset"
            )
        centred = _zero_centred(norm, intervention, path)
        with torch.no_grad():
            weight.fill_(0.0 if centred else 1.0)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
    return new.to(**_like(norm))


def _zero_centred(norm: nn.Module, intervention: str = "norm", path: str = "") -> bool:
    """True for norms that scale by (1 + weight) (Gemma): with weight 0 they still output the
    normalised input. Tried on a copy with a small random input; runs once at apply time. Raises
    InterventionError when the copy cannot run on a (2, 3, width) input."""
    probe = copy.deepcopy(norm).float().cpu()
    weight = getattr(probe, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 1:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, weight.shape[-1], generator=gen)
    with torch.no_grad():
        weight.zero_()
        bias = getattr(probe, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.zero_()
        try:
            y = probe(x)
        except Exception as exc:  # a norm class whose forward wants other inputs
            raise InterventionError(
                intervention,
                path or type(norm).__name__,
                f"a copy of {type(norm).__name__} could not be checked on a (2, 3, {weight.shape[-1]}) "
                f"input ({type(exc).__name__}: {exc})",
            ) from exc
        if not isinstance(y, torch.Tensor):
            raise InterventionError(
                intervention,
                path or type(norm).__name__,
                f"{type(norm).__name__} returns a {type(y).__name__}, not a tensor",
            )
        return bool(y.abs().max() > 1e-3)


def keep_slow_path(handle: Handle, model: nn.Module, path: str) -> None:
    """Make `nn.TransformerEncoderLayer` ancestors of `path` take their Python path (which calls the
    patched submodules) rather than the fused C++ fast path used in eval/no-grad, which would skip
    the intervention: a no-op forward pre-hook on the layer, and ``use_nested_tensor = False`` on
    the enclosing `nn.TransformerEncoder`. Both are undone on remove."""
    parts = path.split(".")
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        module = model.get_submodule(prefix) if prefix else model
        if isinstance(module, nn.TransformerEncoderLayer):
            keep_hook(handle, module.register_forward_pre_hook(no_op_pre_hook))
        elif isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            set_attr(handle, module, "use_nested_tensor", False)


def no_op_pre_hook(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that does nothing; its presence turns off PyTorch's encoder fast path."""
    return None
