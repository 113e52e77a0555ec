"""Discovery from module names and shapes: the fast path, and the fallback when no forward can be
traced (a model on the meta device, FSDP2-sharded parameters, a model stabkit cannot make an input
for). Hints (`inspect_model(override=...)`) are applied here.

Runs once at discovery time; never touches tensor values.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Any

from torch import nn

from .families import attention_impl, family_of, mlp_path, norms_and_placement
from .modelmap import BlockMap, DiscoveryError, LogitsMap, ModelMap
from .roles import derive_shapes, find_attention, is_attention, is_norm, map_attention, out_features

HEAD_NAMES = ("lm_head", "head", "output", "embed_out", "out_head", "classifier", "decoder")
OVERRIDE_HELP = (
    "pass a map: stabkit.inspect_model(model, override={'blocks': 'encoder.layers.*', 'attention': 'attn', "
    "'mlp': 'ffn', 'output_head': 'head'}) or attach(model, ..., model_map=that_map)"
)


def by_names(model: nn.Module, hints: dict[str, Any]) -> ModelMap:
    """The name/shape discovery (the fast path, and the fallback when no forward can be traced)."""
    modules = dict(model.named_modules())
    block_paths = _block_paths(model, modules, hints)
    blocks: list[BlockMap] = []
    families: set[str] = set()
    notes: list[str] = []
    for index, path in enumerate(block_paths):
        block = modules[path]
        family = "override" if hints else family_of(block)
        if hints.get("attention") is not None:
            rel = str(hints["attention"])
        elif family == "torch-encoder":
            rel = "self_attn"
        else:
            rel = find_attention(block) or ""
        attn_path = f"{path}.{rel}" if path and rel else (rel or path)
        if attn_path not in modules:
            raise DiscoveryError(
                f"attention module {attn_path!r} not found in block {path!r}; {OVERRIDE_HELP}"
            )
        amap = map_attention(model, attn_path, attention_impl(family_of(block), modules[attn_path]))
        _apply_attention_hints(amap, hints, attn_path)
        derive_shapes(model, amap)
        fam_for_rules = family_of(block)
        norms, placement, guessed = norms_and_placement(fam_for_rules, block, path)
        if hints.get("placement"):
            placement, guessed = str(hints["placement"]), False
        if guessed and index == 0:
            notes.append("norm placement guessed from module names (pass override={'placement': ...} to fix)")
        mlp_rel = hints.get("mlp") or mlp_path(fam_for_rules, block)
        blocks.append(
            BlockMap(
                index=index,
                path=path,
                attention=amap,
                mlp=f"{path}.{mlp_rel}" if mlp_rel else None,
                norms=norms,
                placement=placement,  # type: ignore[arg-type]
            )
        )
        families.add(family)
    family = families.pop() if len(families) == 1 else "mixed"
    mmap = ModelMap(family=family, blocks=blocks, notes=notes)
    _outer_roles(model, mmap, hints)
    return mmap


def _block_paths(model: nn.Module, modules: dict[str, nn.Module], hints: dict[str, Any]) -> list[str]:
    """Paths of the Transformer blocks: from the hint, else the longest ModuleList (Sequential, or
    ModuleDict as in torchtitan) of attention-bearing children."""
    spec = hints.get("blocks")
    if spec is not None:
        if isinstance(spec, str):
            depth = spec.count(".")  # '*' matches one path segment here: layers.* is not layers.0.attn
            paths = [p for p in modules if p and p.count(".") == depth and fnmatch.fnmatchcase(p, spec)]
        else:
            paths = [str(p) for p in spec]
        missing = [p for p in paths if p not in modules]
        if not paths or missing:
            raise DiscoveryError(f"override 'blocks'={spec!r} matches no module path (missing: {missing})")
        return paths
    best: list[str] = []
    for name, mod in modules.items():
        if not isinstance(mod, nn.ModuleList | nn.Sequential | nn.ModuleDict) or len(mod) == 0:
            continue
        kids = list(mod.named_children())
        if all(not is_attention(c) and find_attention(c) is not None for _, c in kids) and len(kids) > len(
            best
        ):
            best = [f"{name}.{k}" if name else k for k, _ in kids]
    if not best:
        raise DiscoveryError(_nothing_found(model, modules))
    return best


def _nothing_found(model: nn.Module, modules: dict[str, nn.Module]) -> str:
    kinds = Counter(type(m).__name__ for n, m in modules.items() if n)
    common = ", ".join(f"{k}×{v}" for k, v in kinds.most_common(8)) or "no submodules"
    lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList | nn.ModuleDict)]
    return (
        f"no attention found in {type(model).__name__}: stabkit looks for a ModuleList of blocks that each "
        f"contain an attention module (nn.MultiheadAttention or a class named *Attention*/*Attn*). "
        f"Found: {common}; module lists: {lists or 'none'}. If this model has attention, {OVERRIDE_HELP}"
    )


def _apply_attention_hints(amap: Any, hints: dict[str, Any], attn_path: str) -> None:
    for key in ("q", "k", "v", "qkv", "out"):
        if hints.get(key):
            setattr(amap, key, f"{attn_path}.{hints[key]}")
            if key == "qkv":
                amap.q = amap.k = amap.v = None
                amap.qkv_layout = "q|k|v"
    for key in ("n_heads", "n_kv_heads", "head_dim"):
        if hints.get(key):
            setattr(amap, key, int(hints[key]))


def _outer_roles(model: nn.Module, mmap: ModelMap, hints: dict[str, Any]) -> None:
    """Fill embeddings, final norm, output head, d_model and vocab from modules outside the blocks."""
    outside = [
        (n, m)
        for n, m in model.named_modules()
        if n and mmap.block_of(n) is None and not _is_ancestor(n, mmap)
    ]
    after_blocks = False
    last_block = mmap.blocks[-1].path if mmap.blocks else ""
    order = [n for n, _ in model.named_modules()]
    last_index = max((i for i, n in enumerate(order) if n == last_block), default=-1)
    norm_candidates: list[str] = []
    head_candidates: list[str] = []
    for name, mod in outside:
        after_blocks = order.index(name) > last_index
        if isinstance(mod, nn.Embedding):
            mmap.embeddings.append(name)
        elif after_blocks and is_norm(mod):
            norm_candidates.append(name)
        elif after_blocks and out_features(mod) is not None:
            head_candidates.append(name)
    mmap.final_norm = hints.get("final_norm") or (norm_candidates[0] if norm_candidates else None)
    named_heads = [n for n in head_candidates if n.rsplit(".", 1)[-1] in HEAD_NAMES]
    mmap.output_head = hints.get("output_head") or (
        named_heads[-1] if named_heads else (head_candidates[-1] if head_candidates else None)
    )
    if mmap.embeddings:
        emb = model.get_submodule(mmap.embeddings[0])
        mmap.d_model = getattr(emb, "embedding_dim", None)
    if mmap.d_model is None and mmap.blocks:
        a = mmap.first_attention
        if a is not None and a.n_heads and a.head_dim:
            mmap.d_model = a.n_heads * a.head_dim
    if mmap.output_head:
        mmap.vocab_size = out_features(model.get_submodule(mmap.output_head))
        found = "hint" if hints.get("output_head") else "named"
        mmap.logits = LogitsMap(mmap.output_head, None, found)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "logit_softcap", None) or getattr(cfg, "final_logit_softcapping", None):
        mmap.logits = LogitsMap("", None, "named")  # the model caps after its head: read its own output
    elif mmap.embeddings:
        mmap.vocab_size = getattr(model.get_submodule(mmap.embeddings[0]), "num_embeddings", None)


def _is_ancestor(name: str, mmap: ModelMap) -> bool:
    """True when `name` contains the blocks (a container such as `transformer` or `transformer.h`)."""
    return any(b.path.startswith(name + ".") for b in mmap.blocks)
