"""Norm placement: switch blocks between pre-norm, post-norm and sandwich norm.

- ``pre``:      x + f(norm(x))
- ``post``:     norm(x + f(x))
- ``sandwich``: x + norm_out(f(norm_in(x)))  (Chameleon / Gemma 2 / CogView "double" norm)

Where the existing norms go: the norm that guards a sub-layer in pre-norm (``norm1``/``ln_1``/
``input_layernorm`` for attention, ``norm2``/``ln_2``/``post_attention_layernorm`` for the MLP) is the
norm after that sub-layer's residual add in post-norm, and the input norm in sandwich; sandwich
adds one new output norm per sub-layer (same kind and eps as the block's norms, gain 1, bias 0).
The final norm before the head is left alone.

Families:

- stabkit reference GPT: its ``Block.placement`` switch and ``post_norm1``/``post_norm2`` slots (exactly
  the model ``GPTConfig(norm_placement=to)`` builds; state_dict keys match it);
- ``nn.TransformerEncoderLayer``: its ``norm_first`` flag (+ output norms for sandwich);
- nanoGPT-style, HF GPT-2, HF LLaMA-family (pre-norm): ``post`` replaces the block's forward by a
  rewired one (restored on remove); ``sandwich`` adds forward hooks on the attention and MLP modules;
- any other pre-norm block: ``sandwich`` by hooks; pre ↔ post is refused (the wiring is unknown).

For sandwich by hooks the output norm sits on the sub-layer module's output, i.e. after any dropout
inside that module (HF GPT-2's ``resid_dropout``). Runs at each forward of the blocks.
"""

from __future__ import annotations

import inspect as pyinspect
from typing import Any

import torch
from torch import nn

from ..discovery.families import family_of
from ..discovery.modelmap import BlockMap
from .common import (
    add_module,
    keep_hook,
    keep_slow_path,
    map_first,
    model_map,
    norm_like,
    norm_width,
    set_attr,
    swap_module,
)
from .handle import Handle, InterventionError

NAME = "norm_placement"
PLACEMENTS = ("pre", "post", "sandwich")
REWIRED_FAMILIES = ("nanogpt", "hf-gpt2", "hf-llama")
OUT_NORMS = {"attn": "stabkit_post_attn_norm", "mlp": "stabkit_post_mlp_norm"}


def _rel(block: BlockMap, path: str | None) -> str:
    if path is None or not path.startswith(block.path + "."):
        raise InterventionError(NAME, block.path, f"module {path!r} is not inside the block")
    return path[len(block.path) + 1 :]


def _norm_for(block: BlockMap, sublayer: str) -> str:
    """Relative path of the block's norm that guards `sublayer` ('attn' or 'mlp')."""
    found = [n for n in block.norms if n.sublayer == sublayer and n.position != "sandwich"]
    if not found:
        raise InterventionError(NAME, block.path, f"no norm guarding the {sublayer} sub-layer found")
    return _rel(block, found[0].path)


def apply_norm_placement(model: nn.Module, to: str = "sandwich", model_map_override: Any = None) -> Handle:
    """Switch every block of `model` to placement `to` (see the module docstring)."""
    if to not in PLACEMENTS:
        raise InterventionError(NAME, "", f"to must be one of {PLACEMENTS}, got {to!r}")
    mmap = model_map(model, NAME, model_map_override)
    handle = Handle(model, [NAME])
    try:
        for block in mmap.blocks:
            if block.placement == to:
                raise InterventionError(NAME, block.path, f"the block is {to}-norm already")
            module = model.get_submodule(block.path)
            family = family_of(module)
            if family == "stabkit-gpt":
                _stabkit(handle, module, block, to)
            elif family == "torch-encoder":
                _encoder(handle, model, module, block, to)
            elif to == "sandwich" and block.placement == "pre":
                _sandwich_hooks(handle, model, module, block)
            elif (
                to == "post"
                and family in REWIRED_FAMILIES
                and block.placement == "pre"
                and not block.parallel
                and len(block.attentions) == 1
            ):
                _rewire_post(handle, module, block)
            else:
                raise InterventionError(
                    NAME,
                    block.path,
                    f"switching {block.placement}-norm to {to}-norm needs the block's residual wiring, which "
                    f"stabkit knows for the reference GPT, nanoGPT-style, HF GPT-2, HF LLaMA-family and "
                    f"nn.TransformerEncoderLayer blocks (this block is {type(module).__name__}, family {family})",
                )
    except BaseException:
        handle.remove()
        raise
    return handle


def _stabkit(handle: Handle, block: nn.Module, bmap: BlockMap, to: str) -> None:
    """Reference GPT: its placement switch and sandwich slots."""
    if to == "sandwich":
        for slot, src in (("post_norm1", "norm1"), ("post_norm2", "norm2")):
            norm = block.get_submodule(src)
            new = norm_like(NAME, norm, f"{bmap.path}.{slot}", norm_width(norm))
            swap_module(handle, block, slot, new)
            handle.add_parameters(new.parameters())
    else:
        for slot in ("post_norm1", "post_norm2"):
            if block._modules.get(slot) is not None:
                swap_module(handle, block, slot, None)  # taken out of the wiring; back on remove
    set_attr(handle, block, "placement", to)


def _encoder(handle: Handle, model: nn.Module, layer: nn.Module, bmap: BlockMap, to: str) -> None:
    """nn.TransformerEncoderLayer: ``norm_first`` (pre) or not (post); sandwich = pre + output norms."""
    set_attr(handle, layer, "norm_first", to != "post")
    keep_slow_path(handle, model, bmap.path)
    if to == "sandwich":
        _sandwich_hooks(handle, model, layer, bmap)


def _sandwich_hooks(handle: Handle, model: nn.Module, block: nn.Module, bmap: BlockMap) -> None:
    """Output norms on the attention and MLP modules' outputs, registered on the block."""
    targets: list[tuple[str, str, str | None]] = [
        ("attn", OUT_NORMS["attn"] + (f"_{i}" if i else ""), a.output or a.path)
        for i, a in enumerate(bmap.attentions)
    ]
    targets.append(("mlp", OUT_NORMS["mlp"], bmap.mlp))
    for sub, slot, target in targets:
        if target is None:
            raise InterventionError(NAME, bmap.path, f"no {sub} module found for the sandwich output norm")
        if target == bmap.path:
            raise InterventionError(
                NAME,
                bmap.path,
                "attention is computed inline in the block's forward: no sub-layer module "
                "whose output could take the sandwich norm",
            )
        src_path = f"{bmap.path}.{_template_norm(bmap, sub)}"
        src = model.get_submodule(src_path)
        new = norm_like(NAME, src, src_path, norm_width(src))
        add_module(handle, NAME, block, bmap.path, slot, new)

        def hook(mod: nn.Module, args: Any, out: Any, _slot: str = slot) -> Any:
            norm = block.get_submodule(_slot)  # looked up per call: a later rmsnorm swap applies
            return map_first(out, norm)

        keep_hook(handle, model.get_submodule(target).register_forward_hook(hook))


def _template_norm(block: BlockMap, sublayer: str) -> str:
    """The norm a new sandwich output norm copies (kind, eps): the one guarding `sublayer`, else any
    pre norm of the block (a parallel block may share one norm between attention and MLP)."""
    found = [n for n in block.norms if n.sublayer == sublayer and n.position in ("pre", "post")]
    found = found or [n for n in block.norms if n.position in ("pre", "post")]
    if not found:
        raise InterventionError(NAME, block.path, f"no norm guarding the {sublayer} sub-layer found")
    return _rel(block, found[0].path)


def _rewire_post(handle: Handle, block: nn.Module, bmap: BlockMap) -> None:
    """Replace a pre-norm block's forward by ``h = norm_a(x + attn(x)); return norm_m(h + mlp(h))``."""
    if bmap.attention is None:
        raise InterventionError(NAME, bmap.path, "the block has no attention sub-layer to rewire")
    attn_rel = _rel(bmap, bmap.attention.path)
    mlp_rel = _rel(bmap, bmap.mlp)
    norm_a, norm_m = _norm_for(bmap, "attn"), _norm_for(bmap, "mlp")
    original = block.forward
    sig = pyinspect.signature(original)
    params = list(sig.parameters.values())
    if not params or any(p.kind == p.VAR_POSITIONAL for p in params):
        raise InterventionError(NAME, bmap.path, "the block's forward signature is not (hidden_states, ...)")
    first = params[0].name
    var_kw = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        named = dict(sig.bind(*args, **kwargs).arguments)
        x = named.pop(first)  # (B, T, d)
        extra = named.pop(var_kw, {}) if var_kw else {}
        for cross in ("encoder_hidden_states", "encoder_attention_mask"):
            if named.pop(cross, None) is not None:
                raise InterventionError(
                    NAME, bmap.path, "post-norm rewiring does not support cross-attention"
                )
        attn_out = block.get_submodule(attn_rel)(x, **named, **extra)
        if isinstance(attn_out, tuple):
            attn_out = attn_out[0]
        h = block.get_submodule(norm_a)(x + attn_out)
        return block.get_submodule(norm_m)(h + block.get_submodule(mlp_rel)(h))

    set_attr(handle, block, "forward", forward)
