"""`stabkit.inspect_model(model)`: find the Transformer roles of any model and return a ModelMap.

Runs once, before training (at `attach`, `audit`, `interventions.apply`, or from the CLI).
It reads module types, names and shapes only; it never touches tensor values.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .by_names import by_names
from .modelmap import DiscoveryError, ModelMap

OVERRIDE_KEYS = (
    "blocks",
    "attention",
    "mlp",
    "q",
    "k",
    "v",
    "qkv",
    "out",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "final_norm",
    "output_head",
    "placement",
)


def inspect_model(
    model: nn.Module,
    override: dict[str, Any] | ModelMap | None = None,
    *,
    example: Any = None,
    trace: bool = True,
    strict: bool = False,
) -> ModelMap:
    """Find blocks, every attention call site (self and cross; q/k/v or fused qkv, the rows of q and
    k per head, heads, kv heads, head_dim), MLP, norms and their placement, the final norm, the
    output head and the final logits of `model`.

    By behaviour first: one forward is traced (on `example` — a tensor, a tuple of inputs, a dict of
    keyword inputs or an (args, kwargs) pair — or on a small input stabkit makes for token and image
    models) and the roles are read from what the model computes; the RNG streams and buffers are
    restored afterwards. When no forward can be traced (``trace=False``, no example, a sharded
    model) module names are used. `override` always wins: a complete ModelMap (checked and
    returned) or a dict of hints (keys: ``blocks`` glob or list of block paths;
    ``attention``/``mlp`` relative to a block; ``q``/``k``/``v``/``qkv``/``out`` relative to the
    attention; ``n_heads``/``n_kv_heads``/``head_dim``; ``final_norm``/``output_head`` absolute
    paths; ``placement``). What a traced forward cannot find (attention computed in a kernel stabkit
    does not know, say) is listed in `ModelMap.gaps` and said once as a warning — the rest of the map
    stands; with `strict` a gap raises DiscoveryError. Without a trace, raises DiscoveryError, naming
    the role and what was seen, when no attention can be located by names.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"stabkit.inspect_model expects a torch.nn.Module, got {type(model).__name__}; "
            "pass the model itself (not its output or state_dict)"
        )
    if isinstance(override, ModelMap):
        _check_paths(model, override)
        return override
    hints = dict(override or {})
    unknown = sorted(set(hints) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"unknown override key(s) {unknown}; allowed: {list(OVERRIDE_KEYS)}")
    if not hints and trace:
        from .discover import report_gaps, traced_or_named

        mmap = traced_or_named(model, example, by_names)
        report_gaps(model, mmap, strict)
        return mmap
    mmap = by_names(model, hints)
    mmap.found = {k: ("hint" if k in hints else "named") for k in ("blocks", "attention", "placement")}
    return mmap


def _check_paths(model: nn.Module, mmap: ModelMap) -> None:
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    wanted = [mmap.final_norm, mmap.output_head, *mmap.embeddings]
    for b in mmap.blocks:
        wanted += [b.path, b.mlp]
        for a in b.attentions:
            wanted += [a.path, a.q, a.k, a.v, a.qkv, a.out]
    missing = sorted({w for w in wanted if w and w not in names})
    if missing:
        raise DiscoveryError(f"the given ModelMap names paths that are not in the model: {missing}")
