"""xformers' padded-keys and gappy-keys block-diagonal biases measured with the padding not counted as keys
(issue 38, item 4). The biases are the upstream classes (facebookresearch/xformers @ bed3978b, 0.0.35,
``xformers/ops/fmha/attn_bias.py``, copied into the stand-in); the expected allowed entries are built here
by loops from the block lengths, and checked against the bias's own ``materialize`` too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from standins import installed
from standins.reference import reference_stats

from stabkit.attention import kernels

from .test_kernels import Measure, check, randn

torch.set_num_threads(1)
H, D = 2, 8


def _by_hand(
    q_lens: list[int], k_starts: list[int], k_lens: list[int], n_k: int, *, causal: bool, window: tuple
) -> torch.Tensor:
    """(1, 1, Mq, Mk) bool: query block b (packed back to back) sees keys k_starts[b] .. + k_lens[b] - 1,
    query i of the block at key position i + k_len - q_len (bottom-right); causal j <= p; window
    p - left <= j <= p + right (-1: unbounded)."""
    out = torch.zeros(1, 1, sum(q_lens), n_k, dtype=torch.bool)
    q0 = 0
    for lq, k0, lk in zip(q_lens, k_starts, k_lens, strict=True):
        for i in range(lq):
            p = i + lk - lq
            for j in range(lk):
                ok = not (causal and j > p)
                ok = ok and not (window[0] >= 0 and j < p - window[0])
                ok = ok and not (window[1] >= 0 and j > p + window[1])
                out[0, 0, q0 + i, k0 + j] = ok
        q0 += lq
    return out


def _cases() -> list[tuple[str, Any]]:
    q_lens = [3, 4]
    return [
        ("padded", ("BlockDiagonalPaddedKeysMask", "from_seqlens", (q_lens, 6, [4, 5]), [0, 6], 12, False, (-1, -1))),
        ("padded_causal", ("BlockDiagonalCausalWithOffsetPaddedKeysMask", "from_seqlens", (q_lens, 6, [4, 5]), [0, 6],
                           12, True, (-1, -1))),
        ("padded_causal_local", ("BlockDiagonalCausalLocalAttentionPaddedKeysMask", "from_seqlens_local",
                                 (q_lens, 6, [4, 6], 2), [0, 6], 12, True, (1, -1))),
        ("padded_local", ("BlockDiagonalLocalAttentionPaddedKeysMask", "from_seqlens_local", (q_lens, 6, [4, 5], 1, 2),
                          [0, 6], 12, False, (1, 2))),
        ("gappy", ("BlockDiagonalGappyKeysMask", "from_seqlens", (q_lens, [0, 5, 11], [3, 4]), [0, 5], 11, False,
                   (-1, -1))),
        ("gappy_causal", ("BlockDiagonalCausalWithOffsetGappyKeysMask", "from_seqlens", (q_lens, [0, 5, 11], [4, 5]),
                          [0, 5], 11, True, (-1, -1))),
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "spec"), _cases(), ids=[c for c, _ in _cases()])
def test_padded_and_gappy_keys_biases(case: str, spec: Any) -> None:
    cls_name, factory, args, k_starts, n_k, causal, window = spec
    q_lens = args[0]
    k_lens = args[2]
    n_q = sum(q_lens)
    q, k, v = randn(1, n_q, H, D, scale=2), randn(1, n_k, H, D, scale=2), randn(1, n_k, H, D)
    with installed():
        import xformers.ops as xops
        from xformers.ops.fmha import attn_bias

        kw = {"device": torch.device("cpu")} if factory == "from_seqlens" else {}
        bias = getattr(getattr(attn_bias, cls_name), factory)(*args, **kw)
        with kernels.install(), Measure() as m:
            xops.memory_efficient_attention(q, k, v, attn_bias=bias)
        materialised = bias.materialize((n_q, n_k)) == 0
    allowed = _by_hand(q_lens, k_starts, k_lens, n_k, causal=causal, window=window)
    assert torch.equal(materialised, allowed[0, 0])  # the hand-built mask is xformers' own
    want = reference_stats(q.transpose(1, 2), k.transpose(1, 2), attn_mask=allowed)
    check(m.stats[0], want)


def test_paged_biases_are_refused_by_name() -> None:
    from stabkit.attention.kernels.xformers import read_xformers

    class PagedBlockDiagonalPaddedKeysMask:  # the name is what the reader goes by
        pass

    q = randn(1, 4, H, D)
    with pytest.raises(ValueError, match="paged KV cache"):
        read_xformers({"query": q, "key": q, "attn_bias": PagedBlockDiagonalPaddedKeysMask()})
