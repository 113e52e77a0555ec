"""PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; torchtitan's ``VarlenAttention``):
read at the custom ops its Python functions call, ``torch_attn::_varlen_attn`` and
``torch_attn::_varlen_attn_out`` — torch ops, so every function mode sees them without any wrapping.
Read inside the attention module's forward on sampled steps, like every kernel.

Semantics (torch 2.13 ``torch/nn/attention/varlen.py``): packed query (T_q, H, D), key (T_k, H_kv, D)
(GQA with ``enable_gqa``), documents from ``cu_seq_q`` / ``cu_seq_k`` ((N + 1,) cumulative); the
public function sets ``is_causal = window_size == (-1, 0)`` and passes the window on; the op runs
``aten::_flash_attention_forward`` (the cuDNN branch is switched off in 2.13: ``_should_use_cudnn``
returns False), i.e. flash-attn 2's masks: causal and windows aligned bottom-right per document.
``seqused_k`` and ``block_table`` (paged KV caches, inference only) are refused by the reader.

The ops carry their own autograd formula (``register_autograd``) and are called with grad on, so
``qk_norm`` changing q and k at the call reaches the backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..call import Positions, QKCall
from .base import Kernel, add
from .flash import window


def read_varlen(a: Mapping[str, Any]) -> QKCall:
    for name in ("seqused_k", "block_table"):
        if a.get(name) is not None:
            raise ValueError(f"varlen_attn with {name} (a KV cache, inference): not measured")
    cu_q, cu_k = a["cu_seq_q"], a.get("cu_seq_k")
    if cu_k is None:
        raise ValueError("varlen_attn without cu_seq_k: not measured")
    q = a["query"].transpose(0, 1).unsqueeze(0)  # (1, H, T_q, D)
    k = a["key"].transpose(0, 1).unsqueeze(0)  # (1, H_kv, T_k, D)
    left, right = a.get("window_size") or (-1, -1)
    positions = Positions.packed(
        cu_q, cu_k, q.shape[2], k.shape[2], bottom_right=True, causal=bool(a.get("is_causal")),
        window=window(left, right),
    )  # fmt: skip
    return QKCall(q, k, a.get("scale"), positions=positions)


VARLEN = add(
    Kernel(
        "varlen_attn",
        "PyTorch varlen_attn",
        read_varlen,
        ops=("torch_attn::_varlen_attn", "torch_attn::_varlen_attn_out"),
        qk=("query", "key"),
    )
)
