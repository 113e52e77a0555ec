"""STAND-IN for ``transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention``.

Pure PyTorch, tests only (see ``tests/standins/__init__.py``). Followed: NVIDIA/TransformerEngine @ d0067d0d
(2.20.0.dev0) ``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``
(constructor and ``forward`` signatures, mask-type / window / diagonal-alignment resolution, the scale
handed to the ``flash_attention`` / ``fused_attention`` / ``unfused_attention`` backends — the module keeps
no ``softmax_scale`` of its own —, ``_unpack_packed_qkv``),
``.../dot_product_attention/utils.py`` (``check_set_window_size``, ``get_full_mask``, ``get_alibi``)
and ``.../dot_product_attention/backends.py`` (``UnfusedDotProductAttention``: bias order, sink column,
output layouts), which is the pure-PyTorch backend of the real module.

Semantics (i = query row, j = key column of one sequence, Lq / Lk = that sequence's actual lengths):

- ``qkv_format``: "sbhd" (s, b, h, d) and "bshd" (b, s, h, d) -> output (s, b, h·dv) / (b, s, h·dv);
  "thd" (t, h, d) packed sequences with ``cu_seqlens_q`` / ``cu_seqlens_kv`` ((b + 1,) int32; optional
  ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` give where each sequence starts when there are gaps)
  -> output (t, h·dv), each sequence attending only within itself; thd needs a "padding*" mask type.
- ``attn_mask_type`` ∈ no_mask, padding, causal, padding_causal ("padding,causal", "causal,padding",
  "causal_padding" are normalised to it), causal_bottom_right, padding_causal_bottom_right, arbitrary.
- diagonal alignment: ``bottom_right_diagonal`` (ctor or forward) is forced False for causal /
  padding_causal, True for *_bottom_right, and defaults to True for the other types. Bottom-right means
  offset o = Lk - Lq (actual lengths for padding types), top-left o = 0. Causal keeps j <= i + o.
- ``window_size`` (left, right): keeps i + o - left <= j <= i + o + right, -1 = unbounded side; causal
  types force right = 0 (``check_set_window_size``: (-1, -1) with a causal type becomes (-1, 0) etc.).
- padding: sbhd/bshd take ``attention_mask`` (bool, True = padded token; [b, 1, 1, sq] for self
  attention, a (q_mask, kv_mask) tuple for cross) or ``cu_seqlens_q`` / ``cu_seqlens_kv`` (trailing
  padding); padded query rows output zeros. "arbitrary": ``attention_mask`` bool, True = masked out,
  broadcastable to [b, h, sq, skv].
- ``core_attention_bias_type``: "no_bias"; "post_scale_bias" (q·kᵀ·scale + bias); "pre_scale_bias"
  ((q·kᵀ + bias)·scale); "alibi": -slope·|i + o - j| with ``alibi_slopes`` (h,) or (b, h) or TE's
  default slopes. Bias shapes bhss, 1hss, b1ss, 11ss, 111s.
- GQA via ``num_gqa_groups`` (query head h reads kv head h // (heads / groups)).
- ``softmax_type``: "vanilla"; "off-by-one" (a zero logit joins every row's denominator); "learnable"
  (a learnable per-head logit ``softmax_offset``, nn.Parameter of shape (heads,), init 0) — sink attention.
- ``softmax_scale`` defaults to 1/sqrt(kv_channels[0]); ``attention_dropout`` applies in training mode;
  ``return_max_logit=True`` returns (out, max_logit (h,)) with max over allowed q·kᵀ·scale + bias.
- a row with no allowed key outputs zeros.

Not implemented (NotImplementedError): inference_params (KV cache), score_mod* (cuDNN-only), context
parallelism (cp_group with more than one rank). FP8 arguments are accepted and ignored. -1 window sides are
unbounded (the real unfused backend substitutes max_seqlen, which is the same except for top-left
alignment with skv > 2·sq).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from _standin_attention_math import alibi_bias, attention, compute_dtype, expand_kv, scores, window_mask
from torch.utils.checkpoint import checkpoint

from .backends import FlashAttention, FusedAttention, UnfusedDotProductAttention

__standin__ = True

AttnMaskTypes = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
AttnTypes = ("self", "cross")
AttnBiasTypes = ("pre_scale_bias", "post_scale_bias", "no_bias", "alibi")
QKVFormats = ("sbhd", "bshd", "thd")

_attention_backends = {"attention_params": None, "backend_selection_requires_update": False}


def check_set_window_size(attn_mask_type: str, window_size: tuple[int, int] | None = None):
    """As TE's ``dot_product_attention.utils.check_set_window_size``."""
    orig_window_size = window_size
    if "causal" in attn_mask_type:
        if orig_window_size is None:
            window_size = (-1, 0)
        elif orig_window_size == (-1, -1) or (orig_window_size[0] >= 0 and orig_window_size[1] != 0):
            window_size = (orig_window_size[0], 0)
            warnings.warn(
                "window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + attn_mask_type, stacklevel=2
            )
        elif orig_window_size != (-1, 0) and (orig_window_size[0] < 0 or orig_window_size[1] != 0):
            raise AssertionError(
                "window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + attn_mask_type
            )
    elif attn_mask_type in ["no_mask", "padding", "arbitrary"]:
        if orig_window_size is None:
            window_size = (-1, -1)
        elif orig_window_size == (-1, 0):
            window_size = (-1, -1)
            warnings.warn(
                "window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + attn_mask_type,
                stacklevel=2,
            )
        elif orig_window_size != (-1, -1) and (orig_window_size[0] < 0 or orig_window_size[1] < 0):
            raise AssertionError(
                "window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + attn_mask_type
            )
    else:
        raise AssertionError("Invalid attn_mask_type: " + attn_mask_type)
    return tuple(window_size)


def _default_alibi_slopes(num_heads: int) -> torch.Tensor:
    """TE's ``get_alibi`` default slopes."""
    n = 2 ** math.floor(math.log2(num_heads))
    m_0 = 2.0 ** (-8.0 / n)
    m = torch.pow(m_0, torch.arange(1, 1 + n))
    if n < num_heads:
        m_hat_0 = 2.0 ** (-4.0 / n)
        m_hat = torch.pow(m_hat_0, torch.arange(1, 1 + 2 * (num_heads - n), 2))
        m = torch.cat([m, m_hat])
    return m.to(torch.float32)


def _normalise_mask_type(attn_mask_type: str) -> str:
    attn_mask_type = attn_mask_type.replace(",", "_")
    return "padding_causal" if attn_mask_type == "causal_padding" else attn_mask_type


def _trailing_pad_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """(b, s) bool, True = padding, from cumulative lengths (tokens beyond each length are padding)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] >= lengths[:, None]


class DotProductAttention(torch.nn.Module):
    """Stand-in for ``transformer_engine.pytorch.DotProductAttention`` (see the module docstring)."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        tp_group=None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool | None = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.qkv_format = qkv_format
        attn_mask_type = _normalise_mask_type(attn_mask_type)
        self.attn_mask_type = attn_mask_type
        self.window_size = check_set_window_size(attn_mask_type, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.tp_size = tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.tp_group = tp_group
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type
        self.sequence_parallel = sequence_parallel
        self.hidden_size_per_attention_head_k = (
            kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        )
        self.hidden_size_per_attention_head_v = (
            kv_channels if isinstance(kv_channels, int) else kv_channels[1]
        )
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = int(self.num_gqa_groups // self.tp_size)
        assert num_attention_heads % self.num_gqa_groups == 0, (
            "The number of attention heads must be divisible by the number of GQA groups!"
        )
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(kv_channels if isinstance(kv_channels, int) else kv_channels[0])
        assert attention_type in AttnTypes, f"attention_type {attention_type} not supported"
        self.attention_type = attention_type
        self.attention_dropout = attention_dropout
        self.return_max_logit = return_max_logit
        assert softmax_type in ("vanilla", "off-by-one", "learnable"), (
            f"softmax_type {softmax_type} not supported"
        )
        self.softmax_type = softmax_type
        self.softmax_offset = None
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(num_attention_heads // self.tp_size))
        attn_kwargs = {"attention_dropout": attention_dropout}
        self.flash_attention = FlashAttention(
            softmax_scale, attention_type=attention_type, layer_number=layer_number, **attn_kwargs
        )
        self.fused_attention = FusedAttention(
            softmax_scale,
            attention_type=attention_type,
            layer_number=layer_number,
            **attn_kwargs,
            softmax_type=self.softmax_type,
            return_max_logit=self.return_max_logit,
        )
        self.unfused_attention = UnfusedDotProductAttention(
            softmax_scale,
            attention_type=attention_type,
            **attn_kwargs,
            layer_number=layer_number,
            softmax_type=self.softmax_type,
            return_max_logit=self.return_max_logit,
        )

    def _sink(self, device) -> torch.Tensor | None:
        if self.softmax_type == "off-by-one":
            return torch.zeros(self.num_attention_heads // self.tp_size, device=device)
        if self.softmax_type == "learnable":
            return self.softmax_offset
        return None

    def forward(
        self,
        query_layer: torch.Tensor | None = None,
        key_layer: torch.Tensor | None = None,
        value_layer: torch.Tensor | None = None,
        attention_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool | None = False,
        bf16_backward: bool | None = False,
        num_splits: int | None = 1,
        score_mod: Callable | None = None,
        score_mod_bprop: Callable | None = None,
        score_mod_tensors: dict[str, torch.Tensor] | None = None,
        score_mod_bprop_tensors: dict[str, torch.Tensor] | None = None,
        qkv_layer: torch.Tensor | None = None,
        kv_layer: torch.Tensor | None = None,
        qkv_interleave_dim: int = -3,
    ):
        if inference_params is not None:
            raise NotImplementedError(
                "Transformer Engine stand-in: inference_params (KV caching) is not implemented"
            )
        if score_mod is not None or score_mod_bprop is not None:
            raise NotImplementedError("Transformer Engine stand-in: score_mod is a cuDNN-only path")
        if self.cp_group is not None and torch.distributed.get_world_size(self.cp_group) > 1:
            raise NotImplementedError("Transformer Engine stand-in: context parallelism is not implemented")
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        assert qkv_format in QKVFormats, (
            "DotProductAttention only supports qkv_format = {'sbhd', 'bshd', 'thd'}!"
        )
        query_layer, key_layer, value_layer = self._unpack(
            qkv_layer, kv_layer, query_layer, key_layer, value_layer, qkv_interleave_dim
        )
        assert query_layer.dtype == key_layer.dtype == value_layer.dtype, (
            "Queries, keys and values must have the same data type!"
        )
        assert key_layer.shape[:-1] == value_layer.shape[:-1], (
            "Keys and values must have the same batch size, sequence length and number of heads!"
        )
        assert query_layer.shape[-1] == key_layer.shape[-1], (
            "Queries and keys must have the same head dimension!"
        )
        assert query_layer.shape[-1] == self.hidden_size_per_attention_head_k
        assert value_layer.shape[-1] == self.hidden_size_per_attention_head_v
        assert key_layer.shape[-2] == self.num_gqa_groups_per_partition, (
            f"Keys and values must have num_gqa_group = {self.num_gqa_groups_per_partition} heads! "
            f"Found {key_layer.shape[-2]}."
        )

        attn_mask_type = (
            self.attn_mask_type if attn_mask_type is None else _normalise_mask_type(attn_mask_type)
        )
        assert attn_mask_type in AttnMaskTypes, f"Attention mask type {attn_mask_type} is not supported!"
        window_size = check_set_window_size(
            attn_mask_type, self.window_size if window_size is None else window_size
        )
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        if attn_mask_type in {"causal", "padding_causal"}:
            bottom_right_diagonal = False
        if bottom_right_diagonal is None or attn_mask_type in {
            "causal_bottom_right",
            "padding_causal_bottom_right",
        }:
            bottom_right_diagonal = True
        assert core_attention_bias_type in AttnBiasTypes, f"{core_attention_bias_type} not supported"
        if alibi_slopes is not None:
            assert core_attention_bias_type == "alibi", (
                "core_attention_bias_type must be alibi in order to use alibi_slopes!"
            )
        if core_attention_bias_type == "alibi":
            assert core_attention_bias is None, (
                "core_attention_bias must be None when core_attention_bias_type is alibi!"
            )

        args = (
            query_layer,
            key_layer,
            value_layer,
            attention_mask,
            qkv_format,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            attn_mask_type,
            window_size,
            bottom_right_diagonal,
            core_attention_bias_type,
            core_attention_bias,
            alibi_slopes,
        )
        if checkpoint_core_attention:
            return checkpoint(self._core, *args, use_reentrant=False)
        return self._core(*args)

    def _unpack(self, qkv_layer, kv_layer, query_layer, key_layer, value_layer, qkv_interleave_dim):
        """As TE's ``_unpack_packed_qkv``: zero-copy views of a packed qkv / kv buffer."""
        if qkv_layer is None and kv_layer is None:
            if query_layer is None or key_layer is None or value_layer is None:
                raise ValueError(
                    "query_layer, key_layer and value_layer are required unless packed"
                    " inputs (qkv_layer or query_layer + kv_layer) are provided."
                )
            return query_layer, key_layer, value_layer
        if qkv_layer is not None and kv_layer is not None:
            raise ValueError("qkv_layer and kv_layer are mutually exclusive.")
        if qkv_interleave_dim not in (-3, -2):
            raise ValueError(
                f"qkv_interleave_dim must be -3 (e.g. bs3hd) or -2 (e.g. bsh3d), got {qkv_interleave_dim}."
            )
        if qkv_layer is not None:
            q, k, v = (qkv_layer.select(qkv_interleave_dim, i) for i in range(3))
            return q, k, v
        if query_layer is None:
            raise ValueError(
                "kv_layer packs only K and V: query_layer is required when kv_layer is provided."
            )
        k, v = (kv_layer.select(qkv_interleave_dim, i) for i in range(2))
        return query_layer, k, v

    def _core(
        self,
        q,
        k,
        v,
        attention_mask,
        qkv_format,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        attn_mask_type,
        window_size,
        bottom_right_diagonal,
        core_attention_bias_type,
        core_attention_bias,
        alibi_slopes,
    ):
        total_q = None
        if qkv_format == "sbhd":
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        if qkv_format == "thd":
            assert all(x.dim() == 3 for x in (q, k, v)), (
                "Queries, keys and values must be 3D tensors when qkv_format = thd!"
            )
            assert "padding" in attn_mask_type, (
                "Attention mask type must be padding or padding_causal for qkv_format=thd!"
            )
            assert cu_seqlens_q is not None and cu_seqlens_kv is not None, (
                "cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd!"
            )
            total_q = q.shape[0]
            q_idx, pad_q = self._thd_index(cu_seqlens_q, cu_seqlens_q_padded)
            k_idx, pad_k = self._thd_index(cu_seqlens_kv, cu_seqlens_kv_padded)
            q, k, v = q[q_idx], k[k_idx], v[k_idx]
        else:
            assert all(x.dim() == 4 for x in (q, k, v)), (
                f"Queries, keys and values must be 4D tensors when {qkv_format=}!"
            )
            pad_q = pad_k = None
            if "padding" in attn_mask_type:
                pad_q, pad_k = self._bshd_padding(
                    attention_mask, cu_seqlens_q, cu_seqlens_kv, q.shape[1], k.shape[1]
                )
        # q, k, v are (b, s, h, d) here
        batch, sq, heads, _ = q.shape
        sk = k.shape[1]
        device = q.device
        cd = compute_dtype(q.dtype)
        if pad_q is None:
            len_q = torch.full((batch,), sq, device=device)
            len_k = torch.full((batch,), sk, device=device)
        else:
            len_q, len_k = (~pad_q).sum(1), (~pad_k).sum(1)
        offsets = (len_k - len_q).tolist() if bottom_right_diagonal else [0] * batch
        causal = "causal" in attn_mask_type
        allowed = torch.stack(
            [
                window_mask(
                    sq,
                    sk,
                    offset=int(o),
                    causal=causal,
                    window_left=window_size[0],
                    window_right=window_size[1],
                    device=device,
                )
                for o in offsets
            ]
        ).unsqueeze(1)
        if pad_q is not None:
            allowed = allowed & ~pad_q[:, None, :, None] & ~pad_k[:, None, None, :]
        if attn_mask_type == "arbitrary":
            assert attention_mask is not None, "attention_mask is required for attn_mask_type='arbitrary'"
            allowed = allowed & ~attention_mask.to(torch.bool)

        bias = pre_bias = None
        if core_attention_bias_type == "post_scale_bias":
            assert core_attention_bias is not None, "core_attention_bias should not be None!"
            bias = core_attention_bias.to(cd)
        elif core_attention_bias_type == "pre_scale_bias":
            assert core_attention_bias is not None, "core_attention_bias should not be None!"
            pre_bias = core_attention_bias.to(cd)
        elif core_attention_bias_type == "alibi":
            slopes = _default_alibi_slopes(heads).to(device) if alibi_slopes is None else alibi_slopes
            bias = torch.cat(
                [
                    alibi_bias(sq, sk, slopes if slopes.dim() == 1 else slopes[b], offset=int(o), dtype=cd)
                    for b, o in enumerate(offsets)
                ]
            )

        qt, kt, vt = (x.transpose(1, 2).to(cd) for x in (q, k, v))
        sink = self._sink(device)
        dropout_p = self.attention_dropout if self.training else 0.0
        out, _, _ = attention(
            qt,
            kt,
            vt,
            scale=self.unfused_attention.softmax_scale,
            allowed=allowed,
            bias=bias,
            pre_scale_bias=pre_bias,
            sink=sink,
            dropout_p=dropout_p,
        )
        out = out.transpose(1, 2).to(q.dtype)  # (b, sq, h, dv)
        if qkv_format == "thd":
            flat = torch.zeros((total_q, *out.shape[2:]), dtype=out.dtype, device=device)
            flat = flat.index_put((q_idx[~pad_q],), out[~pad_q])
            out = flat.reshape(total_q, -1)
        elif qkv_format == "sbhd":
            out = out.transpose(0, 1).reshape(sq, batch, -1)
        else:
            out = out.reshape(batch, sq, -1)
        if self.return_max_logit:
            s = scores(
                qt,
                expand_kv(kt, heads),
                scale=self.unfused_attention.softmax_scale,
                allowed=allowed,
                bias=bias,
                pre_scale_bias=pre_bias,
            )
            return out, torch.amax(s, dim=(0, 2, 3))
        return out

    @staticmethod
    def _thd_index(cu_seqlens, cu_seqlens_padded):
        """(b, max_len) token indices of each sequence in the packed tensor and the (b, max_len) padding mask."""
        assert cu_seqlens.dtype == torch.int32, "cu_seqlens_q and cu_seqlens_kv must be in dtype torch.int32!"
        starts = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)[:-1]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_len = max(int(lengths.max()), 1)
        pos = torch.arange(max_len, device=cu_seqlens.device)[None, :]
        pad = pos >= lengths[:, None]
        idx = torch.where(pad, torch.zeros_like(pos), starts[:, None].long() + pos)
        return idx, pad

    def _bshd_padding(self, attention_mask, cu_seqlens_q, cu_seqlens_kv, sq, sk):
        if attention_mask is not None:
            if self.attention_type == "self":
                m = attention_mask.reshape(attention_mask.shape[0], -1).to(torch.bool)
                return m, m
            mq, mk = attention_mask
            return mq.reshape(mq.shape[0], -1).to(torch.bool), mk.reshape(mk.shape[0], -1).to(torch.bool)
        assert cu_seqlens_q is not None and cu_seqlens_kv is not None, (
            "Please provide attention_mask for padding!"
        )
        return _trailing_pad_mask(cu_seqlens_q, sq), _trailing_pad_mask(cu_seqlens_kv, sk)
