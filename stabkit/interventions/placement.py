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
inside that module (HF GPT-2's ``resid_dropout``): the module whose output is added to the residual
stream. When the module mapped for a sub-layer cannot output the block's width (a map naming a
parameter-free child that wraps ``F.scaled_dot_product_attention`` and returns the heads before the
out projection) the innermost ancestor inside the block that can is taken; none: refused. A norm is
never hooked onto an output whose last dim is not its width (refused at apply time when the module's
structure tells, else at the first forward, which `apply` runs to check it).

Hybrids: a block without attention (a Mamba / convolution layer) gets an output norm on its token
mixer's output when discovery found it pre-norm with a mixer and an MLP (otherwise it is refused,
naming the block), and so does a mixer discovery found beside a block's attention (Falcon-H1's
Mamba). Refused too, as a sandwich on part of a block or of the model would be a silent partial
no-op: a block holding a child that looks like a sub-layer but has no role in the map, and a layer
list holding layers of the blocks' class that are not mapped as blocks. Runs at each forward of the
blocks.
"""

from __future__ import annotations

import inspect as pyinspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..discovery.families import family_of
from ..discovery.modelmap import AttentionMap, BlockMap, ModelMap
from ..discovery.roles import is_norm, out_features
from ..plugins import INTERVENTIONS
from .base import Intervention, choices
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
OUT_NORMS = {
    "attn": "stabkit_post_attn_norm",
    "mixer": "stabkit_post_mixer_norm",
    "mlp": "stabkit_post_mlp_norm",
}
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""Modules that hold a model's layers."""
SUBLAYER_NAMES = re.compile(
    r"mamba|ssm|mixer|conv|linear_?attn|linear_?attention|recurren|rwkv|hyena|retention|moe|expert", re.I
)
"""Names (module or class) of sub-layers that write to the residual stream besides attention and MLP."""


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _inside(path: str, block: str) -> bool:
    """True when `path` is strictly inside the block at `block`."""
    return path != block and (block == "" or path.startswith(block + "."))


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _rel(block: BlockMap, path: str | None) -> str:
    if path is None or not _inside(path, block.path):
        raise InterventionError(NAME, block.path, f"module {path!r} is not inside the block")
    return path[len(block.path) + 1 :] if block.path else path


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
    if not mmap.blocks:
        raise InterventionError(NAME, type(model).__name__, "no Transformer blocks found")
    handle = Handle(model, [NAME])
    try:
        for block in mmap.blocks:
            if block.placement == to:
                raise InterventionError(NAME, block.path, f"the block is {to}-norm already")
            module = model.get_submodule(block.path)
            family = family_of(module)
            if block.attention is None:
                _mixer_block(handle, model, module, block, to)
            elif family == "stabkit-gpt":
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
                _rewire_post(handle, model, module, block)
            else:
                raise InterventionError(
                    NAME,
                    block.path,
                    f"switching {block.placement}-norm to {to}-norm needs the block's residual wiring, which "
                    f"stabkit knows for the reference GPT, nanoGPT-style, HF GPT-2, HF LLaMA-family and "
                    f"nn.TransformerEncoderLayer blocks (this block is {type(module).__name__}, family {family})",
                )
        _refuse_unmapped_layers(model, mmap)
    except BaseException:
        handle.remove()
        raise
    return handle


def _stabkit(handle: Handle, block: nn.Module, bmap: BlockMap, to: str) -> None:
    """Reference GPT: its placement switch and sandwich slots."""
    if to == "sandwich":
        for slot, src in (("post_norm1", "norm1"), ("post_norm2", "norm2")):
            norm = block.get_submodule(src)
            path = f"{bmap.path}.{slot}"
            new = norm_like(NAME, norm, path, norm_width(norm, NAME, f"{bmap.path}.{src}"))
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


def _mixer_block(handle: Handle, model: nn.Module, block: nn.Module, bmap: BlockMap, to: str) -> None:
    """A block without attention (a hybrid's Mamba / convolution / linear-attention layer): sandwich
    by hooks on its token mixer and MLP when discovery found it pre-norm; anything else is refused."""
    what = f"block without attention ({type(block).__name__}, token mixer {bmap.mixer or 'not found'})"
    if to != "sandwich":
        raise InterventionError(
            NAME,
            bmap.path,
            f"{what}: switching it to {to}-norm needs its residual wiring, which stabkit does not know for "
            "token-mixing layers (only sandwich output norms can be added there)",
        )
    if bmap.mixer is None:
        raise InterventionError(NAME, bmap.path, f"{what}: no token-mixing module to take the sandwich norm")
    if bmap.placement != "pre":
        raise InterventionError(
            NAME,
            bmap.path,
            f"{what}: its norm placement is {bmap.placement} (a sandwich norm needs a pre-norm block whose "
            "norms discovery placed around its mixer and MLP)",
        )
    _sandwich_hooks(handle, model, block, bmap)


def _sandwich_hooks(handle: Handle, model: nn.Module, block: nn.Module, bmap: BlockMap) -> None:
    """Output norms on the attention, token mixer and MLP modules' outputs, registered on the block."""
    targets: list[tuple[str, str, str]] = []
    for i, a in enumerate(bmap.attentions):
        _refuse_inline(bmap, a)
        width = _width(model, bmap, "attn")
        targets.append(
            ("attn", OUT_NORMS["attn"] + (f"_{i}" if i else ""), _attention_output(model, bmap, a, width))
        )
    if bmap.attention is None and bmap.mixer is None:
        raise InterventionError(NAME, bmap.path, "no token mixer module found for the sandwich output norm")
    if bmap.mixer is not None:  # a hybrid's Mamba / conv layer, or a mixer beside the attention (Falcon-H1)
        width = _width(model, bmap, "mixer")
        targets.append(
            ("mixer", OUT_NORMS["mixer"], _output_module(model, bmap, bmap.mixer, width, "token mixer"))
        )
    if bmap.mlp is None:
        raise InterventionError(NAME, bmap.path, "no mlp module found for the sandwich output norm")
    targets.append(
        ("mlp", OUT_NORMS["mlp"], _output_module(model, bmap, bmap.mlp, _width(model, bmap, "mlp"), "MLP"))
    )
    _refuse_unmapped_sublayers(model, bmap, [t for *_, t in targets], width)
    for sub, slot, target in targets:
        src_path = f"{bmap.path}.{_template_norm(bmap, sub)}" if bmap.path else _template_norm(bmap, sub)
        src = model.get_submodule(src_path)
        width = norm_width(src, NAME, src_path)
        new = norm_like(NAME, src, src_path, width)
        add_module(handle, NAME, block, bmap.path, slot, new)
        keep_hook(
            handle,
            model.get_submodule(target).register_forward_hook(_out_norm_hook(block, slot, target, width)),
        )


def _out_norm_hook(block: nn.Module, slot: str, target: str, width: int) -> Any:
    """The forward hook putting the norm ``block.<slot>`` on the output of the module at `target`."""

    def normed(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != width:
            raise InterventionError(
                NAME,
                target,
                f"its output has shape {tuple(x.shape)}, whose last dim is not the width {width} of the "
                "sandwich norm: it is not the sub-layer output added to the residual stream",
            )
        return block.get_submodule(slot)(x)  # looked up per call: a later rmsnorm swap applies

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        if not (
            isinstance(out, torch.Tensor)
            or (isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor))
        ):
            raise InterventionError(
                NAME,
                target,
                f"its output is a {type(out).__name__}, not a tensor (or a tuple starting with one)",
            )
        return map_first(out, normed)

    return hook


def _width(model: nn.Module, bmap: BlockMap, sublayer: str) -> int:
    """Width of the norm that a new output norm for `sublayer` copies: the block's residual width."""
    rel = _template_norm(bmap, sublayer)
    path = f"{bmap.path}.{rel}" if bmap.path else rel
    return norm_width(model.get_submodule(path), NAME, path)


def _attention_output(model: nn.Module, bmap: BlockMap, a: AttentionMap, width: int) -> str:
    """The module whose output is attention site `a`'s sub-layer output (added to the residual)."""
    _refuse_inline(bmap, a)
    start = a.output or a.path
    return _output_module(model, bmap, start, width, f"attention sub-layer (call site {a.path})")


def _refuse_inline(bmap: BlockMap, a: AttentionMap) -> None:
    if (a.output or a.path) == bmap.path:
        raise InterventionError(
            NAME,
            bmap.path,
            "attention is computed inline in the block's forward: no sub-layer module "
            "whose output could take the sandwich norm",
        )


def _may_output(module: nn.Module, width: int) -> bool | None:
    """Whether `module`'s output can have last dim `width`: True / False when its structure tells
    (a Linear, nn.MultiheadAttention, a module holding a projection to `width`; a module without
    parameters holds no out projection: it returns what it was given, e.g. heads before the out
    projection), None when it cannot be told without running it."""
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim == width
    own = out_features(module)
    if own is not None:
        return own == width
    if next(iter(module.parameters()), None) is None:
        return False
    for m in module.modules():
        if out_features(m) == width or (isinstance(m, nn.MultiheadAttention) and m.embed_dim == width):
            return True
    return None


def _output_module(model: nn.Module, bmap: BlockMap, start: str, width: int, what: str) -> str:
    """The module whose output is a sub-layer's output: `start` (the module discovery mapped) or,
    when that one cannot output the block's width, the innermost ancestor inside the block that can
    (the first whose structure says so; else the first that might)."""
    if not _inside(start, bmap.path):
        raise InterventionError(NAME, bmap.path, f"the {what} module {start!r} is not inside the block")
    path, maybe = start, None
    while _inside(path, bmap.path):
        module = model.get_submodule(path)
        if not isinstance(module, nn.ModuleList | nn.ModuleDict):  # never called: no output
            fits = _may_output(module, width)
            if fits:
                return path
            if fits is None and maybe is None:
                maybe = path
        path = _parent(path)
    if maybe is not None:
        return maybe
    raise InterventionError(
        NAME,
        start,
        f"no module from {start!r} up to the block {bmap.path!r} outputs the block's width {width}: the "
        f"{what} output added to the residual stream is made in the block's own forward, where no "
        "sandwich norm can be hooked",
    )


def _template_norm(block: BlockMap, sublayer: str) -> str:
    """The norm a new sandwich output norm copies (kind, eps): the one guarding `sublayer`, else any
    pre norm of the block (a parallel block may share one norm between attention and MLP)."""
    found = [n for n in block.norms if n.sublayer == sublayer and n.position in ("pre", "post")]
    found = found or [n for n in block.norms if n.position in ("pre", "post")]
    if not found:
        raise InterventionError(NAME, block.path, f"no norm guarding the {sublayer} sub-layer found")
    return _rel(block, found[0].path)


def _roles(bmap: BlockMap, extra: list[str]) -> list[str]:
    paths = [*extra, *(n.path for n in bmap.norms)]
    for a in bmap.attentions:
        paths += [p for p in (a.path, a.output, a.q, a.k, a.v, a.qkv, a.out) if p]
    paths += [p for p in (bmap.mlp, bmap.mixer) if p]
    return paths


def _refuse_unmapped_sublayers(model: nn.Module, bmap: BlockMap, targets: list[str], width: int) -> None:
    """Refuse a block holding a child that discovery gave no role but that looks like a sub-layer
    writing to the residual stream (a module holding a projection back to the block's width, or named
    like a Mamba / convolution / MoE layer): its output would not get the sandwich norm (Falcon-H1's
    Mamba beside the attention, GraniteMoeHybrid's MoE beside its shared MLP). Leaves (the first
    Linear of an MLP mapped by its last one, a LayerScale gain) and norms are not sub-layers."""
    roles = _roles(bmap, targets)
    block = model.get_submodule(bmap.path)
    for name, child in block.named_children():
        path = f"{bmap.path}.{name}" if bmap.path else name
        if any(_under(r, path) or _under(path, r) for r in roles):
            continue
        if (
            is_norm(child)
            or next(child.children(), None) is None
            or next(iter(child.parameters()), None) is None
        ):
            continue
        writes = any(out_features(m) == width for m in child.modules())
        if writes or SUBLAYER_NAMES.search(name) or SUBLAYER_NAMES.search(type(child).__name__):
            raise InterventionError(
                NAME,
                bmap.path,
                f"its child {name!r} ({type(child).__name__}) looks like a sub-layer writing to the residual "
                "stream that discovery mapped to no role (not the attention, token mixer or MLP): its output "
                "would not be changed (pass model_map= with the block's roles)",
            )


def _refuse_unmapped_layers(model: nn.Module, mmap: ModelMap) -> None:
    """Refuse a model whose block container holds layers of a block's class that discovery did not
    map as blocks (a hybrid's Mamba / linear-attention layers of the same decoder-layer class): they
    would keep their placement while the rest of the model switches."""
    mapped = {b.path for b in mmap.blocks}
    for parent in dict.fromkeys(_parent(b.path) for b in mmap.blocks if b.path):
        container = model.get_submodule(parent)
        if not isinstance(container, CONTAINERS):
            continue
        classes = {type(model.get_submodule(b.path)) for b in mmap.blocks if _parent(b.path) == parent}
        for name, layer in container.named_children():
            path = f"{parent}.{name}"
            if path in mapped or type(layer) not in classes or next(iter(layer.parameters()), None) is None:
                continue
            if any(_under(b, path) or _under(path, b) for b in mapped):
                continue
            raise InterventionError(
                NAME,
                path,
                f"a layer of the blocks' class {type(layer).__name__} that discovery did not map as a block "
                "(a hybrid model's token-mixing layer?): it would keep its norm placement while the other "
                "blocks switch (pass model_map= with every block)",
            )


def _rewire_post(handle: Handle, model: nn.Module, block: nn.Module, bmap: BlockMap) -> None:
    """Replace a pre-norm block's forward by ``h = norm_a(x + attn(x)); return norm_m(h + mlp(h))``."""
    if bmap.attention is None:
        raise InterventionError(NAME, bmap.path, "the block has no attention sub-layer to rewire")
    if bmap.mlp is None:
        raise InterventionError(NAME, bmap.path, "no mlp module found to rewire")
    if bmap.mixer is not None:
        raise InterventionError(
            NAME,
            bmap.path,
            f"the block has a token mixer ({bmap.mixer}) beside its attention, which the post-norm "
            "forward (norm(x + attn(x)), then norm(h + mlp(h))) would leave out",
        )
    width = _width(model, bmap, "attn")
    attn_path = _output_module(
        model, bmap, bmap.attention.path, width, f"attention sub-layer (call site {bmap.attention.path})"
    )
    mlp_path = _output_module(model, bmap, bmap.mlp, _width(model, bmap, "mlp"), "MLP")
    _refuse_unmapped_sublayers(model, bmap, [attn_path, mlp_path], width)
    attn_rel, mlp_rel = _rel(bmap, attn_path), _rel(bmap, mlp_path)
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


@dataclass(frozen=True)
class NormPlacementOptions:
    """The options of ``norm_placement``."""

    to: str = field(default="sandwich", metadata=choices(*PLACEMENTS))
    """Where the block norms go: 'pre', 'post' or 'sandwich' (an extra norm on each sub-layer output)."""


@INTERVENTIONS.register
class NormPlacementIntervention(Intervention):
    """``norm_placement``: move the block norms (norm surgery: applied after rmsnorm, before attention)."""

    name = NAME
    order = 20
    description = (
        "move the block norms: pre, post, or sandwich (extra norm on each sub-layer output before the add)"
    )
    options_class = NormPlacementOptions

    def apply(self, model: nn.Module, model_map: Any, options: NormPlacementOptions) -> Handle:
        return apply_norm_placement(model, options.to, model_map)
