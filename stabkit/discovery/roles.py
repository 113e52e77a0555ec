"""Name and shape rules that find roles (attention, projections, MLP, norms) inside one block.

Runs once at discovery time; never touches tensor values.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from .modelmap import AttentionMap, NormMap

Q_NAMES = ("q_proj", "query", "q", "wq", "to_q", "q_lin", "query_proj")
K_NAMES = ("k_proj", "key", "k", "wk", "to_k", "k_lin", "key_proj")
V_NAMES = ("v_proj", "value", "v", "wv", "to_v", "v_lin", "value_proj")
QKV_NAMES = ("c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj", "wqkv")
OUT_NAMES = ("o_proj", "out_proj", "c_proj", "proj", "wo", "dense", "o", "to_out", "out_lin", "output")
HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads", "nhead", "n_heads_q")
KV_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "n_head_kv")
ATTN_PATTERN = re.compile(r"attn|attention", re.IGNORECASE)
ATTN_NAME_PREFERENCE = ("self_attn", "attn", "attention", "self_attention", "mha")
NORM_SUBLAYER_HINTS = {
    "attn": ("ln_1", "norm1", "input_layernorm", "attention_norm", "ln_attn", "attn_norm", "pre_attn_norm"),
    "mlp": ("ln_2", "norm2", "post_attention_layernorm", "ffn_norm", "ln_mlp", "mlp_norm", "pre_mlp_norm"),
}


def out_features(module: nn.Module | None) -> int | None:
    """Output width of a linear-like module (nn.Linear, HF Conv1D), else None."""
    if module is None:
        return None
    if isinstance(module, nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None:
        return int(weight.shape[1])  # HF Conv1D stores (in, out)
    return None


def in_features(module: nn.Module | None) -> int | None:
    """Input width of a linear-like module, else None."""
    if module is None:
        return None
    if isinstance(module, nn.Linear):
        return module.in_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None:
        return int(weight.shape[0])
    return None


def is_norm(module: nn.Module) -> bool:
    """True for LayerNorm, RMSNorm and classes whose name says Norm (but not BatchNorm-free guards)."""
    if isinstance(module, nn.LayerNorm | nn.RMSNorm | nn.GroupNorm):
        return True
    name = type(module).__name__
    return "Norm" in name and not isinstance(module, nn.ModuleList | nn.Sequential)


def norm_kind(module: nn.Module) -> str:
    """'layernorm', 'rmsnorm' or the class name."""
    name = type(module).__name__.lower()
    if "rms" in name:
        return "rmsnorm"
    if isinstance(module, nn.LayerNorm) or "layernorm" in name:
        return "layernorm"
    return type(module).__name__


def is_attention(module: nn.Module) -> bool:
    """True for nn.MultiheadAttention and for modules whose class name says attention."""
    if isinstance(module, nn.MultiheadAttention):
        return True
    if isinstance(module, nn.Linear | nn.Dropout | nn.Embedding) or is_norm(module):
        return False
    return bool(ATTN_PATTERN.search(type(module).__name__))


def find_attention(block: nn.Module) -> str | None:
    """Relative path of the (self-)attention module inside `block`, shallowest first."""
    found = [(name, m) for name, m in block.named_modules() if name and is_attention(m)]
    if not found:
        return None
    found.sort(key=lambda nm: (nm[0].count("."), _preference(nm[0])))
    return found[0][0]


def _preference(name: str) -> int:
    leaf = name.rsplit(".", 1)[-1]
    return ATTN_NAME_PREFERENCE.index(leaf) if leaf in ATTN_NAME_PREFERENCE else len(ATTN_NAME_PREFERENCE)


def child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    """The first direct child of `module` whose name is in `names`."""
    children = dict(module.named_children())
    for n in names:
        if n in children:
            return n
    return None


def first_int(objs: list[Any], attrs: tuple[str, ...]) -> int | None:
    """First integer attribute among `attrs` on any of `objs` (module, then its config)."""
    for obj in objs:
        if obj is None:
            continue
        for a in attrs:
            value = getattr(obj, a, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def map_attention(root: nn.Module, path: str, impl: str = "unknown") -> AttentionMap:
    """Find projections, heads and head_dim of the attention module at `path` in `root`."""
    attn = root.get_submodule(path)
    amap = AttentionMap(path=path, impl=impl)
    join = lambda n: f"{path}.{n}" if n else None  # noqa: E731
    if isinstance(attn, nn.MultiheadAttention):
        amap.impl = "torch_mha"
        amap.n_heads = attn.num_heads
        amap.n_kv_heads = attn.num_heads
        amap.head_dim = attn.head_dim
        amap.out = join("out_proj")
        if attn.in_proj_weight is not None:
            amap.qkv, amap.qkv_layout = f"{path}.in_proj_weight", "q|k|v"
        else:
            amap.q, amap.k, amap.v = (
                f"{path}.{n}" for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")
            )
        return amap
    amap.q, amap.k, amap.v = (
        join(child(attn, Q_NAMES)),
        join(child(attn, K_NAMES)),
        join(child(attn, V_NAMES)),
    )
    if not (amap.q and amap.k):
        amap.q = amap.k = amap.v = None
        amap.qkv = join(child(attn, QKV_NAMES))
        amap.qkv_layout = "q|k|v" if amap.qkv else None
    amap.out = join(child(attn, OUT_NAMES))
    config = getattr(attn, "config", None)
    amap.n_heads = first_int([attn, config], HEAD_ATTRS)
    amap.head_dim = first_int([attn, config], ("head_dim",))
    amap.n_kv_heads = first_int([attn, config], KV_ATTRS)
    derive_shapes(root, amap)
    return amap


def derive_shapes(root: nn.Module, amap: AttentionMap) -> None:
    """Fill head_dim / n_heads / n_kv_heads that are still None from the projections' widths."""
    q_width = out_features(root.get_submodule(amap.q)) if amap.q else None
    k_width = out_features(root.get_submodule(amap.k)) if amap.k else None
    qkv_width = (
        out_features(root.get_submodule(amap.qkv)) if amap.qkv and ".in_proj" not in amap.qkv else None
    )
    if amap.head_dim is None and amap.n_heads and q_width:
        amap.head_dim = q_width // amap.n_heads
    if amap.head_dim is None and amap.n_heads and qkv_width:
        amap.head_dim = qkv_width // 3 // amap.n_heads  # fused [q, k, v], MHA
    if amap.n_heads is None and amap.head_dim and q_width:
        amap.n_heads = q_width // amap.head_dim
    if amap.n_kv_heads is None and k_width and amap.head_dim:
        amap.n_kv_heads = k_width // amap.head_dim
    if amap.n_kv_heads is None:
        amap.n_kv_heads = amap.n_heads


def block_norms(block: nn.Module, prefix: str, position: str = "pre") -> list[NormMap]:
    """Direct-child norms of `block`, with the sub-layer each guards guessed from its name or order."""
    norms: list[NormMap] = []
    ordered = [(n, m) for n, m in block.named_children() if is_norm(m)]
    for i, (name, mod) in enumerate(ordered):
        sub = "unknown"
        for role, hints in NORM_SUBLAYER_HINTS.items():
            if name in hints:
                sub = role
        if sub == "unknown" and len(ordered) == 2:
            sub = ("attn", "mlp")[i]
        norms.append(NormMap(path=f"{prefix}.{name}", kind=norm_kind(mod), sublayer=sub, position=position))
    return norms
