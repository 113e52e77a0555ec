"""The stand-ins for flash-attn 2/3, xformers and Transformer Engine match a float64 materialised softmax
attention with the documented mask semantics, their gradients match autograd through it, their torch ops
carry the real names and schemas, and the float64 reference's statistics match brute force."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import PACKAGES_DIR, install, installed, is_installed, uninstall
from .reference import reference_attention, reference_masks, reference_stats

TOL = {"atol": 1e-10, "rtol": 1e-9}


@pytest.fixture
def standins():
    """The stand-ins, with no stabkit entry-point wrapper left by an earlier test in this process (a
    dropped intervention is collected; a hold still alive loses its wrappers until its next install):
    these tests spy on the libraries' own calls."""
    gc.collect()
    from stabkit.attention.kernels import entry_points

    entry_points._unpatch_all()
    with installed():
        yield


@pytest.fixture
def fa2(standins):
    return importlib.import_module("flash_attn")


@pytest.fixture
def fa3(standins):
    return importlib.import_module("flash_attn_interface")


@pytest.fixture
def xops(standins):
    return importlib.import_module("xformers.ops")


@pytest.fixture
def te(standins):
    return importlib.import_module("transformer_engine.pytorch")


def rand(*shape, seed=None, requires_grad=True):
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def bhsd(x):
    """(batch, seq, heads, dim) -> (batch, heads, seq, dim)."""
    return x.transpose(1, 2)


def packed_bhsd(x):
    """(total, heads, dim) -> (1, heads, total, dim)."""
    return x.transpose(0, 1).unsqueeze(0)


def assert_grads_match(out, ref, inputs):
    """Backward through the stand-in and through the float64 reference give the same, finite gradients."""
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, g, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for a, b in zip(got, want):
        assert a is not None and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)


def op_name(func) -> str | None:
    """'namespace::name' of a custom op as a TorchFunctionMode sees it (OpOverloadPacket or OpOverload)."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    return None


class FunctionSpy(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if name is not None:
            self.ops.append((type(func).__name__, name))
        return func(*args, **(kwargs or {}))


class DispatchSpy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith("flash_attn"):
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------
# installation
# ------------------------------------------------------------------------------------------------


def test_packages_are_off_the_path_unless_installed():
    assert not is_installed()
    assert importlib.util.find_spec("flash_attn") is None
    with installed():
        spec = importlib.util.find_spec("flash_attn")
        assert spec is not None and str(PACKAGES_DIR) in spec.origin
        import flash_attn
        import flash_attn_interface
        import transformer_engine
        import xformers

        for module in (flash_attn, flash_attn_interface, xformers, transformer_engine):
            assert module.__standin__ is True
        assert flash_attn.__version__ == "2.8.4+standin"
    assert importlib.util.find_spec("flash_attn") is None
    assert importlib.util.find_spec("xformers") is None
    install()
    install()  # idempotent, and the modules come back (custom ops cannot be registered twice)
    try:
        assert importlib.import_module("flash_attn") is flash_attn
    finally:
        uninstall()


REAL_SCHEMAS = {
    "flash_attn::_flash_attn_forward": "flash_attn::_flash_attn_forward(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)",
    "flash_attn::_flash_attn_varlen_forward": "flash_attn::_flash_attn_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left=-1, SymInt window_size_right=-1, float softcap=0., Tensor? alibi_slopes=None, bool return_softmax=False, Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, bool zero_tensors=False, SymInt num_splits=0) -> (Tensor, Tensor, Tensor, Tensor)",
    "flash_attn::_flash_attn_backward": "flash_attn::_flash_attn_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a6!)? dq, Tensor(a7!)? dk, Tensor(a8!)? dv, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, Tensor? rng_state=None) -> Tensor",
    "flash_attn_3::_flash_attn_forward": "flash_attn_3::_flash_attn_forward(Tensor q, Tensor k, Tensor v, Tensor? k_new=None, Tensor? v_new=None, Tensor? qv=None, Tensor? out_=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool causal=False, SymInt window_size_left=-1, SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0., bool rotary_interleaved=True, Tensor? scheduler_metadata=None, SymInt num_splits=1, bool? pack_gqa=None, SymInt sm_margin=0) -> (Tensor, Tensor, Tensor, Tensor)",
}


def test_custom_ops_have_the_real_names_and_schemas(fa2, fa3):
    """Schemas as torch infers them from the real flash-attn 2.8.4 / hopper sources (checked once against them)."""
    for qualified, schema in REAL_SCHEMAS.items():
        ns, name = qualified.split("::")
        assert str(getattr(getattr(torch.ops, ns), name).default._schema) == schema


# ------------------------------------------------------------------------------------------------
# flash-attn 2
# ------------------------------------------------------------------------------------------------

FA2_DENSE = {
    "causal-square": dict(sq=5, sk=5, causal=True),
    "causal-q<k": dict(sq=3, sk=7, causal=True),
    "causal-q>k-empty-rows": dict(sq=7, sk=3, causal=True),
    "window": dict(sq=6, sk=6, window=(2, 1)),
    "window-q<k": dict(sq=4, sk=7, window=(1, 2)),
    "causal+window-left": dict(sq=4, sk=7, causal=True, window=(2, -1)),
    "window(-1,0)=causal": dict(sq=5, sk=6, window=(-1, 0)),
    "softcap": dict(sq=5, sk=5, causal=True, softcap=0.7),
    "alibi-h": dict(sq=4, sk=6, alibi="h"),
    "alibi-bh-causal": dict(sq=4, sk=6, alibi="bh", causal=True),
    "mqa": dict(sq=5, sk=5, causal=True, hk=1),
}


@pytest.mark.parametrize("case", FA2_DENSE.values(), ids=FA2_DENSE.keys())
def test_fa2_func_matches_reference(fa2, case):
    b, h, d = 2, 4, 6  # head dim 6: the real wrapper pads it to 8 before the op
    hk = case.get("hk", 2)
    q, k, v = rand(b, case["sq"], h, d, seed=0), rand(b, case["sk"], hk, d), rand(b, case["sk"], hk, d)
    slopes = {"h": torch.rand(h, dtype=torch.float64), "bh": torch.rand(b, h, dtype=torch.float64)}.get(
        case.get("alibi")
    )
    window, causal, softcap = (
        case.get("window", (-1, -1)),
        case.get("causal", False),
        case.get("softcap", 0.0),
    )
    out = fa2.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes
    )
    ref = reference_attention(
        bhsd(q),
        bhsd(k),
        bhsd(v),
        causal=causal,
        causal_align="bottom_right",
        window=window,
        softcap=softcap,
        alibi_slopes=slopes,
    )
    torch.testing.assert_close(out, bhsd(ref), **TOL)
    assert_grads_match(out, bhsd(ref), (q, k, v))


def test_fa2_rows_without_keys_give_zero_output_and_inf_lse(fa2):
    q, k, v = rand(1, 5, 2, 8, seed=1), rand(1, 2, 2, 8), rand(1, 2, 2, 8)
    out, lse, s_dmask = fa2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    # bottom-right causal with seqlen_q = 5, seqlen_k = 2: rows 0..2 see no key (flash-attn's docstring example)
    assert (out[:, :3] == 0).all() and (out[:, 3:] != 0).any()
    assert torch.isposinf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 5) and s_dmask.numel() == 0


FA2_VARLEN = {
    "causal": dict(causal=True),
    "window": dict(window=(1, 0)),
    "alibi-per-doc": dict(alibi=True, causal=True),
    "softcap": dict(softcap=1.5),
}


@pytest.mark.parametrize("case", FA2_VARLEN.values(), ids=FA2_VARLEN.keys())
def test_fa2_varlen_matches_reference_per_document(fa2, case):
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 15], dtype=torch.int32)
    h, hk, d = 4, 2, 8
    q, k, v = rand(10, h, d, seed=2), rand(15, hk, d), rand(15, hk, d)
    slopes = torch.rand(3, h, dtype=torch.float64) if case.get("alibi") else None
    kw = dict(
        causal=case.get("causal", False),
        window=case.get("window", (-1, -1)),
        softcap=case.get("softcap", 0.0),
    )
    out = fa2.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        5,
        6,
        causal=kw["causal"],
        window_size=kw["window"],
        softcap=kw["softcap"],
        alibi_slopes=slopes,
    )
    ref = reference_attention(
        packed_bhsd(q),
        packed_bhsd(k),
        packed_bhsd(v),
        causal_align="bottom_right",
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        alibi_slopes=slopes,
        **kw,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, **TOL)
    assert_grads_match(out, ref, (q, k, v))


def _fa2_entry_points(fa2):
    """name -> (call, reference output in the entry point's layout, differentiable inputs, op seen)."""
    b, s, h, hk, d = 2, 5, 4, 2, 8
    fwd, varlen = "flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward"
    torch.manual_seed(3)
    qkv = rand(b, s, 3, h, d)
    q, kv = rand(b, 4, h, d), rand(b, s, 2, hk, d)
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8], dtype=torch.int32)
    vqkv = rand(7, 3, h, d)
    vq, vkv = rand(7, h, d), rand(8, 2, hk, d)

    def dense_ref(q_, k_, v_):
        return bhsd(
            reference_attention(bhsd(q_), bhsd(k_), bhsd(v_), causal=True, causal_align="bottom_right")
        )

    def varlen_ref(q_, k_, v_, cq, ck):
        r = reference_attention(
            packed_bhsd(q_),
            packed_bhsd(k_),
            packed_bhsd(v_),
            causal=True,
            causal_align="bottom_right",
            cu_seqlens_q=cq,
            cu_seqlens_k=ck,
        )
        return r[0].transpose(0, 1)

    return {
        "flash_attn_qkvpacked_func": (
            lambda: fa2.flash_attn_qkvpacked_func(qkv, causal=True),
            lambda: dense_ref(*qkv.unbind(2)),
            (qkv,),
            fwd,
        ),
        "flash_attn_kvpacked_func": (
            lambda: fa2.flash_attn_kvpacked_func(q, kv, causal=True),
            lambda: dense_ref(q, *kv.unbind(2)),
            (q, kv),
            fwd,
        ),
        "flash_attn_varlen_qkvpacked_func": (
            lambda: fa2.flash_attn_varlen_qkvpacked_func(vqkv, cu, 5, causal=True),
            lambda: varlen_ref(*vqkv.unbind(1), cu, cu),
            (vqkv,),
            varlen,
        ),
        "flash_attn_varlen_kvpacked_func": (
            lambda: fa2.flash_attn_varlen_kvpacked_func(vq, vkv, cu, cu_k, 5, 5, causal=True),
            lambda: varlen_ref(vq, *vkv.unbind(1), cu, cu_k),
            (vq, vkv),
            varlen,
        ),
        "flash_attn_func": (
            lambda: fa2.flash_attn_func(q, *kv.unbind(2), causal=True),
            lambda: dense_ref(q, *kv.unbind(2)),
            (q, kv),
            fwd,
        ),
        "flash_attn_varlen_func": (
            lambda: fa2.flash_attn_varlen_func(vq, *vkv.unbind(1), cu, cu_k, 5, 5, causal=True),
            lambda: varlen_ref(vq, *vkv.unbind(1), cu, cu_k),
            (vq, vkv),
            varlen,
        ),
    }


@pytest.mark.parametrize(
    "entry",
    [
        "flash_attn_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_kvpacked_func",
        "flash_attn_varlen_func",
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func",
    ],
)
def test_fa2_entry_points_reach_the_real_op_and_match_reference(fa2, entry):
    call, ref_fn, inputs, op = _fa2_entry_points(fa2)[entry]
    with FunctionSpy() as spy:
        out = call()
    assert spy.ops == [("OpOverloadPacket", op)]  # packed entry points unpack q/k/v before the op
    ref = ref_fn()
    torch.testing.assert_close(out, ref, **TOL)
    with DispatchSpy() as dispatch:
        assert_grads_match(out, ref, inputs)
    assert dispatch.ops == [op.replace("forward", "backward")]  # a dispatch mode also sees the backward op


def test_fa2_dropout_and_paged_kv_are_refused(fa2):
    q = rand(1, 4, 2, 8, seed=4)
    with pytest.raises(NotImplementedError, match="dropout"):
        fa2.flash_attn_func(q, q, q, dropout_p=0.1)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        fa2.flash_attn_varlen_func(
            q[0], q[0], q[0], cu, cu, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32)
        )


def test_fa2_bert_padding_round_trip(fa2):
    from flash_attn.bert_padding import pad_input, unpad_input

    x = rand(2, 5, 3, seed=5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    flat, indices, cu, max_len, used = unpad_input(x, mask)
    assert flat.shape == (8, 3) and cu.tolist() == [0, 3, 8] and max_len == 5 and used.tolist() == [3, 5]
    back = pad_input(flat, indices, 2, 5)
    torch.testing.assert_close(back, x * mask[..., None])


def test_fa2_with_kvcache_appends_and_attends(fa2):
    k_cache, v_cache = (
        torch.zeros(2, 8, 2, 8, dtype=torch.float64),
        torch.zeros(2, 8, 2, 8, dtype=torch.float64),
    )
    q, k, v = (rand(2, 3, 2, 8, seed=6, requires_grad=False) for _ in range(3))
    out = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2, causal=True)
    assert (k_cache[:, 2:5] == k).all() and (k_cache[:, 5:] == 0).all()
    ref = reference_attention(
        bhsd(q), bhsd(k_cache[:, :5]), bhsd(v_cache[:, :5]), causal=True, causal_align="bottom_right"
    )
    torch.testing.assert_close(out, bhsd(ref), **TOL)


# ------------------------------------------------------------------------------------------------
# flash-attn 3
# ------------------------------------------------------------------------------------------------

FA3_DENSE = {
    "causal-q<k": dict(sq=4, sk=7, causal=True),
    "window": dict(sq=6, sk=6, window=(2, 1)),
    "softcap-gqa": dict(sq=5, sk=5, causal=True, softcap=0.8),
    "chunk": dict(sq=8, sk=8, chunk=3),
    "chunk+causal": dict(sq=8, sk=8, causal=True, chunk=3),
    "chunk+causal-q<k": dict(sq=5, sk=9, causal=True, chunk=4),
    "chunk+window": dict(sq=9, sk=9, window=(2, 2), chunk=4),
}


@pytest.mark.parametrize("case", FA3_DENSE.values(), ids=FA3_DENSE.keys())
def test_fa3_func_matches_reference(fa3, case):
    b, h, hk, d = 2, 4, 2, 8
    q, k, v = rand(b, case["sq"], h, d, seed=7), rand(b, case["sk"], hk, d), rand(b, case["sk"], hk, d)
    kw = dict(causal=case.get("causal", False), softcap=case.get("softcap", 0.0))
    window, chunk = case.get("window", (-1, -1)), case.get("chunk", 0)
    with FunctionSpy() as spy:
        out = fa3.flash_attn_func(q, k, v, window_size=window, attention_chunk=chunk, **kw)
    assert spy.ops == [("OpOverload", "flash_attn_3::_flash_attn_forward")]
    ref = bhsd(
        reference_attention(
            bhsd(q), bhsd(k), bhsd(v), causal_align="bottom_right", window=window, chunk=chunk, **kw
        )
    )
    torch.testing.assert_close(out, ref, **TOL)
    if chunk:
        # as in the real library: "FA3 backward does not support attention_chunk"
        with pytest.raises(AssertionError, match="attention_chunk"):
            out.sum().backward()
    else:
        assert_grads_match(out, ref, (q, k, v))


def test_fa3_varlen_and_packed_match_reference(fa3):
    h, hk, d = 4, 2, 8
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 15], dtype=torch.int32)
    q, k, v = rand(10, h, d, seed=8), rand(15, hk, d), rand(15, hk, d)
    with FunctionSpy() as spy:
        out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, window_size=(2, 0))
    assert spy.ops == [
        ("OpOverload", "flash_attn_3::_flash_attn_forward")
    ]  # varlen = same op, cu_seqlens set
    ref = reference_attention(
        packed_bhsd(q),
        packed_bhsd(k),
        packed_bhsd(v),
        causal=True,
        causal_align="bottom_right",
        window=(2, 0),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, **TOL)
    assert_grads_match(out, ref, (q, k, v))

    chunked = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, attention_chunk=2)
    ref = reference_attention(
        packed_bhsd(q),
        packed_bhsd(k),
        packed_bhsd(v),
        causal=True,
        causal_align="bottom_right",
        chunk=2,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )[0].transpose(0, 1)
    torch.testing.assert_close(chunked, ref, **TOL)

    qkv = rand(2, 5, 3, h, d)
    with FunctionSpy() as spy:
        out = fa3.flash_attn_qkvpacked_func(qkv, causal=True)
    assert spy.ops == [("OpOverload", "flash_attn_3::_flash_attn_forward")]
    ref = bhsd(
        reference_attention(*(bhsd(x) for x in qkv.unbind(2)), causal=True, causal_align="bottom_right")
    )
    torch.testing.assert_close(out, ref, **TOL)
    assert_grads_match(out, ref, (qkv,))

    gqa = rand(2, 5, h + 2 * hk, d)  # 4-dim packing with num_heads_q
    out = fa3.flash_attn_qkvpacked_func(gqa, causal=True, num_heads_q=h)
    qg, kg, vg = gqa.split([h, hk, hk], dim=2)
    ref = bhsd(reference_attention(bhsd(qg), bhsd(kg), bhsd(vg), causal=True, causal_align="bottom_right"))
    torch.testing.assert_close(out, ref, **TOL)
    assert_grads_match(out, ref, (gqa,))


def test_fa3_empty_rows_and_unsupported_features(fa3):
    q, k, v = rand(1, 5, 2, 8, seed=9), rand(1, 2, 2, 8), rand(1, 2, 2, 8)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert (out[:, :3] == 0).all() and torch.isneginf(lse[..., :3]).all()  # FA3 writes -inf
    with pytest.raises(NotImplementedError, match="qv"):
        fa3.flash_attn_func(q, k, v, qv=q)
    import flash_attn_3.flash_attn_interface as packaged

    assert packaged.flash_attn_func is fa3.flash_attn_func


# ------------------------------------------------------------------------------------------------
# xformers
# ------------------------------------------------------------------------------------------------


def _xformers_cases(ab):
    t = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    return {
        # name: (bias, Mq, Mk, batch, reference kwargs)
        "none": (None, 5, 7, 2, {}),
        "tensor": (t, 5, 7, 2, dict(attn_mask=t)),
        "LowerTriangularMask-top-left": (ab.LowerTriangularMask(), 5, 7, 2, dict(causal=True)),
        "LowerTriangularMaskWithTensorBias": (
            ab.LowerTriangularMask().add_bias(t),
            5,
            7,
            2,
            dict(causal=True, attn_mask=t),
        ),
        "LowerTriangularFromBottomRightMask": (
            ab.LowerTriangularFromBottomRightMask(),
            4,
            7,
            2,
            dict(causal=True, causal_align="bottom_right"),
        ),
        "LowerTriangularFromBottomRightLocalAttentionMask": (
            ab.LowerTriangularFromBottomRightMask().make_local_attention(3),
            5,
            7,
            2,
            dict(causal=True, causal_align="bottom_right", window=(2, -1)),
        ),
        "LocalAttentionFromBottomRightMask": (
            ab.LocalAttentionFromBottomRightMask(window_left=1, window_right=2),
            4,
            6,
            2,
            dict(causal_align="bottom_right", window=(1, 2)),
        ),
        "BlockDiagonalMask": (
            ab.BlockDiagonalMask.from_seqlens([3, 4, 2], [2, 5, 3]),
            9,
            10,
            1,
            dict(cu=([0, 3, 7, 9], [0, 2, 7, 10])),
        ),
        "BlockDiagonalCausalMask": (
            ab.BlockDiagonalMask.from_seqlens([3, 4, 2]).make_causal(),
            9,
            9,
            1,
            dict(causal=True, cu=([0, 3, 7, 9], [0, 3, 7, 9])),
        ),
        "BlockDiagonalCausalMask-q!=k": (
            ab.BlockDiagonalCausalMask.from_seqlens([3, 2], [2, 4]),
            5,
            6,
            1,
            dict(causal=True, cu=([0, 3, 5], [0, 2, 6])),
        ),
        "BlockDiagonalCausalFromBottomRightMask": (
            ab.BlockDiagonalMask.from_seqlens([2, 3], [4, 5]).make_causal_from_bottomright(),
            5,
            9,
            1,
            dict(causal=True, causal_align="bottom_right", cu=([0, 2, 5], [0, 4, 9])),
        ),
        "BlockDiagonalCausalLocalAttentionMask": (
            ab.BlockDiagonalMask.from_seqlens([4, 5]).make_local_attention(2),
            9,
            9,
            1,
            dict(causal=True, window=(1, -1), cu=([0, 4, 9], [0, 4, 9])),
        ),
        "BlockDiagonalCausalLocalAttentionFromBottomRightMask": (
            ab.BlockDiagonalMask.from_seqlens([2, 3], [4, 5]).make_local_attention_from_bottomright(3),
            5,
            9,
            1,
            dict(causal=True, causal_align="bottom_right", window=(2, -1), cu=([0, 2, 5], [0, 4, 9])),
        ),
    }


XFORMERS_IDS = [
    "none",
    "tensor",
    "LowerTriangularMask-top-left",
    "LowerTriangularMaskWithTensorBias",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LocalAttentionFromBottomRightMask",
    "BlockDiagonalMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalCausalMask-q!=k",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
]


def _ref_kwargs(kw):
    kw = dict(kw)
    cu = kw.pop("cu", None)
    if cu is not None:
        kw["cu_seqlens_q"], kw["cu_seqlens_k"] = (torch.tensor(c, dtype=torch.int32) for c in cu)
    return kw


@pytest.mark.parametrize("name", XFORMERS_IDS)
def test_xformers_biases_match_reference(xops, name):
    from xformers.ops import fmha

    torch.manual_seed(10)
    bias, mq, mk, batch, kw = _xformers_cases(fmha.attn_bias)[name]
    kw = _ref_kwargs(kw)
    h, d = 3, 4
    q, k, v = rand(batch, mq, h, d), rand(batch, mk, h, d), rand(batch, mk, h, d)
    out = xops.memory_efficient_attention(q, k, v, attn_bias=bias)
    ref = bhsd(reference_attention(bhsd(q), bhsd(k), bhsd(v), **kw))
    torch.testing.assert_close(out, ref, **TOL)
    assert_grads_match(out, ref, (q, k, v))
    if isinstance(bias, fmha.attn_bias.AttentionBias) and not isinstance(
        bias, fmha.attn_bias.LowerTriangularMaskWithTensorBias
    ):
        # materialize(): 0 where allowed, -inf where blocked, as the real method
        dense = bias.materialize((mq, mk), dtype=torch.float32)
        allowed, _ = reference_masks(
            bhsd(q)[:1, :1], bhsd(k)[:1, :1], **{k_: v_ for k_, v_ in kw.items() if k_ != "attn_mask"}
        )
        assert torch.equal(dense == 0, allowed[0, 0]) and torch.isneginf(dense[~allowed[0, 0]]).all()


def test_xformers_layouts_and_attributes(xops):
    from xformers.ops import fmha

    assert xops.memory_efficient_attention is fmha.memory_efficient_attention
    # BMGHK: G kv groups of H query heads each; key/value expanded (xformers does not broadcast)
    b, m, g, hg, d = 2, 5, 2, 3, 4
    q = rand(b, m, g, hg, d, seed=11)
    k1, v1 = rand(b, m, g, 1, d), rand(b, m, g, 1, d)
    out = xops.memory_efficient_attention(q, k1.expand(-1, -1, -1, hg, -1), v1.expand(-1, -1, -1, hg, -1))
    ref = reference_attention(
        bhsd(q.reshape(b, m, g * hg, d)), bhsd(k1.reshape(b, m, g, d)), bhsd(v1.reshape(b, m, g, d))
    )
    torch.testing.assert_close(out.reshape(b, m, g * hg, d), bhsd(ref), **TOL)
    with pytest.raises(ValueError, match="broadcasting"):
        xops.memory_efficient_attention(q, k1, v1)
    # BMK (H = 1) with a causal mask
    q3, k3, v3 = rand(2, 5, 4), rand(2, 5, 4), rand(2, 5, 4)
    out = xops.memory_efficient_attention(q3, k3, v3, attn_bias=xops.LowerTriangularMask())
    ref = reference_attention(q3[:, None], k3[:, None], v3[:, None], causal=True)[:, 0]
    torch.testing.assert_close(out, ref, **TOL)
    # the block-diagonal attributes stabkit may read
    bias = fmha.attn_bias.BlockDiagonalMask.from_seqlens([3, 4], [2, 6]).make_causal()
    assert bias.q_seqinfo.seqstart_py == [0, 3, 7] and bias.k_seqinfo.seqstart_py == [0, 2, 8]
    assert bias.q_seqinfo.seqstart.dtype == torch.int32 and bias.q_seqinfo.max_seqlen == 4
    local = fmha.attn_bias.BlockDiagonalMask.from_seqlens([4, 5]).make_local_attention(2)
    assert type(local).__name__ == "BlockDiagonalCausalLocalAttentionMask" and local._window_size == 2
    with pytest.raises(ValueError, match="batch_size=1"):
        xops.memory_efficient_attention(rand(2, 7, 1, 4), rand(2, 8, 1, 4), rand(2, 8, 1, 4), attn_bias=bias)


# ------------------------------------------------------------------------------------------------
# Transformer Engine
# ------------------------------------------------------------------------------------------------

TE_CASES = {
    # name: (ctor kwargs, forward kwargs, sq, sk, reference kwargs)
    "sbhd-causal": (dict(qkv_format="sbhd"), {}, 5, 5, dict(causal=True)),
    "bshd-causal-cross-top-left": (
        dict(qkv_format="bshd", attention_type="cross"),
        {},
        4,
        6,
        dict(causal=True),
    ),
    "bshd-causal_bottom_right-cross": (
        dict(qkv_format="bshd", attention_type="cross", attn_mask_type="causal_bottom_right"),
        {},
        4,
        6,
        dict(causal=True, causal_align="bottom_right"),
    ),
    "sbhd-no_mask-window-bottom-right": (
        dict(attn_mask_type="no_mask", window_size=(2, 1), attention_type="cross"),
        {},
        4,
        6,
        dict(window=(2, 1), causal_align="bottom_right"),
    ),
    "bshd-no_mask-window-top-left": (
        dict(qkv_format="bshd", attn_mask_type="no_mask", window_size=(1, 1), bottom_right_diagonal=False),
        {},
        4,
        6,
        dict(window=(1, 1)),
    ),
    "bshd-causal-window": (
        dict(qkv_format="bshd", window_size=(2, 0)),
        {},
        6,
        6,
        dict(causal=True, window=(2, 0)),
    ),
    "sbhd-causal-alibi": (
        {},
        dict(core_attention_bias_type="alibi", alibi_slopes="h"),
        5,
        5,
        dict(causal=True, alibi_slopes="h"),
    ),
    "bshd-no_mask-alibi-bottom-right": (
        dict(qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross"),
        dict(core_attention_bias_type="alibi", alibi_slopes="h"),
        3,
        6,
        dict(causal_align="bottom_right", alibi_slopes="h"),
    ),
    "bshd-post_scale_bias": (
        dict(qkv_format="bshd", attn_mask_type="no_mask"),
        dict(core_attention_bias_type="post_scale_bias", core_attention_bias="bias"),
        5,
        5,
        dict(attn_mask="bias"),
    ),
    "sbhd-learnable-sink": (dict(softmax_type="learnable"), {}, 5, 5, dict(causal=True, sinks="learnable")),
    "sbhd-off-by-one-sink": (dict(softmax_type="off-by-one"), {}, 5, 5, dict(causal=True, sinks="zeros")),
}


@pytest.mark.parametrize("name", TE_CASES)
def test_te_dot_product_attention_matches_reference(te, name):
    ctor, fwd, sq, sk, kw = TE_CASES[name]
    b, h, g, d = 2, 4, 2, 8
    torch.manual_seed(12)
    module = te.DotProductAttention(h, d, num_gqa_groups=g, **ctor)
    if module.softmax_offset is not None:
        with torch.no_grad():
            module.softmax_offset.copy_(torch.randn(h))
    module.double()
    fmt = ctor.get("qkv_format", "sbhd")
    q, k, v = rand(b, sq, h, d), rand(b, sk, g, d), rand(b, sk, g, d)
    slopes, bias = torch.rand(h, dtype=torch.float64), torch.randn(1, h, sq, sk, dtype=torch.float64)
    fwd = {
        key: {"h": slopes, "bias": bias}.get(val, val) if isinstance(val, str) else val
        for key, val in fwd.items()
    }
    kw = {
        key: {"h": slopes, "bias": bias}.get(val, val) if isinstance(val, str) else val
        for key, val in kw.items()
    }
    if kw.get("sinks") == "learnable":
        kw["sinks"] = module.softmax_offset
    elif kw.get("sinks") == "zeros":
        kw["sinks"] = torch.zeros(h, dtype=torch.float64)
    layout = (lambda x: x.transpose(0, 1)) if fmt == "sbhd" else (lambda x: x)
    out = module(layout(q), layout(k), layout(v), **fwd)
    ref = bhsd(reference_attention(bhsd(q), bhsd(k), bhsd(v), **kw))  # (b, sq, h, d)
    ref = layout(ref).reshape(*layout(ref).shape[:2], h * d)  # TE returns (s, b, h·d) / (b, s, h·d)
    torch.testing.assert_close(out, ref, **TOL)
    params = (q, k, v) + ((module.softmax_offset,) if module.softmax_offset is not None else ())
    assert_grads_match(out, ref, params)


@pytest.mark.parametrize(
    ("mask_type", "window", "ref_kw"),
    [
        ("padding_causal", None, dict(causal=True)),
        ("padding_causal_bottom_right", None, dict(causal=True, causal_align="bottom_right")),
        ("padding", (1, 1), dict(window=(1, 1), causal_align="bottom_right")),
    ],
)
def test_te_thd_matches_reference_per_sequence(te, mask_type, window, ref_kw):
    h, g, d = 4, 2, 8
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_kv = torch.tensor([0, 4, 9, 15], dtype=torch.int32)
    q, k, v = rand(10, h, d, seed=13), rand(15, g, d), rand(15, g, d)
    module = te.DotProductAttention(
        h,
        d,
        num_gqa_groups=g,
        qkv_format="thd",
        attn_mask_type=mask_type,
        window_size=window,
        attention_type="cross",
    )
    out = module(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert out.shape == (10, h * d)
    ref = reference_attention(
        packed_bhsd(q), packed_bhsd(k), packed_bhsd(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, **ref_kw
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref.reshape(10, h * d), **TOL)
    assert_grads_match(out, ref.reshape(10, h * d), (q, k, v))


def test_te_padding_bshd_max_logit_and_packed_qkv(te):
    h, d = 2, 8
    q, k, v = rand(2, 6, h, d, seed=14), rand(2, 6, h, d), rand(2, 6, h, d)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)  # lengths 4 and 6: batch 0 has 2 padded tokens
    module = te.DotProductAttention(
        h, d, qkv_format="bshd", attn_mask_type="padding_causal", return_max_logit=True
    )
    out, max_logit = module(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    pad = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    valid = ~pad[:, None, :, None] & ~pad[:, None, None, :]
    ref = bhsd(reference_attention(bhsd(q), bhsd(k), bhsd(v), causal=True, attn_mask=valid))
    torch.testing.assert_close(out, ref.reshape(2, 6, h * d), **TOL)
    assert (out[0, 4:] == 0).all()
    stats = reference_stats(bhsd(q), bhsd(k), causal=True, attn_mask=valid)
    torch.testing.assert_close(max_logit, stats["scores"].amax(dim=(0, 2, 3)), **TOL)
    same = module(q, k, v, attention_mask=pad[:, None, None, :])[0]  # padding given as a mask, True = pad
    torch.testing.assert_close(same, out, **TOL)
    qkv = torch.stack([q, k, v], dim=2)  # bs3hd
    torch.testing.assert_close(module(qkv_layer=qkv, cu_seqlens_q=cu, cu_seqlens_kv=cu)[0], out, **TOL)


# ------------------------------------------------------------------------------------------------
# the float64 reference against brute force
# ------------------------------------------------------------------------------------------------


def brute_force_stats(q, k, allowed_fn, *, scale=None, softcap=0.0, bias_fn=None, sinks=None, score_fn=None):
    """Per-element python-float computation of the four statistics from a predicate allowed_fn(b, h, i, j)."""
    b_size, h_size, l_size, e = q.shape
    s_size, group = k.shape[2], h_size // k.shape[1]
    scale = e**-0.5 if scale is None else scale
    out = {"max_logit": [], "entropy": [], "sink_mass": [], "rows": []}
    for h in range(h_size):
        max_logit, entropies, sink_masses = 0.0, [], []
        for b in range(b_size):
            for i in range(l_size):
                logits = []
                for j in range(s_size):
                    if not allowed_fn(b, h, i, j):
                        continue
                    x = sum(float(q[b, h, i, t]) * float(k[b, h // group, j, t]) for t in range(e)) * scale
                    max_logit = max(max_logit, abs(x))
                    s = softcap * math.tanh(x / softcap) if softcap > 0 else x
                    s += bias_fn(b, h, i, j) if bias_fn else 0.0
                    logits.append(score_fn(s, b, h, i, j) if score_fn else s)
                if not logits:
                    continue
                if sinks is not None:
                    logits.append(float(sinks[h]))
                m = max(logits)
                z = sum(math.exp(s - m) for s in logits)
                ps = [math.exp(s - m) / z for s in logits]
                entropies.append(-sum(p * math.log(p) for p in ps if p > 0))
                sink_masses.append(ps[-1] if sinks is not None else 0.0)
        n = len(entropies)
        out["max_logit"].append(max_logit)
        out["entropy"].append(sum(entropies) / n if n else 0.0)
        out["sink_mass"].append(sum(sink_masses) / n if n else 0.0)
        out["rows"].append(n)
    return {
        key: torch.tensor(val, dtype=torch.int64 if key == "rows" else torch.float64)
        for key, val in out.items()
    }


def assert_stats_equal(got, want):
    for key in ("max_logit", "entropy", "sink_mass", "rows"):
        torch.testing.assert_close(got[key], want[key], **TOL, msg=key)


def test_reference_stats_equal_brute_force_dense_with_sinks():
    torch.manual_seed(15)
    b, h, hkv, l_size, s_size, e = 2, 4, 2, 4, 6, 3
    q, k = (
        torch.randn(b, h, l_size, e, dtype=torch.float64) * 3,
        torch.randn(b, hkv, s_size, e, dtype=torch.float64),
    )
    slopes, sinks = torch.rand(h, dtype=torch.float64), torch.randn(h, dtype=torch.float64)
    keep = torch.rand(b, 1, l_size, s_size) > 0.2
    got = reference_stats(
        q,
        k,
        causal=True,
        causal_align="bottom_right",
        window=(2, -1),
        alibi_slopes=slopes,
        softcap=1.5,
        sinks=sinks,
        attn_mask=keep,
    )

    def allowed(b_, h_, i, j):
        d = i + s_size - l_size
        return j <= d and j >= d - 2 and bool(keep[b_, 0, i, j])

    want = brute_force_stats(
        q,
        k,
        allowed,
        softcap=1.5,
        bias_fn=lambda b_, h_, i, j: -float(slopes[h_]) * abs(i + s_size - l_size - j),
        sinks=sinks,
    )
    assert_stats_equal(got, want)
    assert (got["sink_mass"] > 0).all() and got["rows"].tolist() == want["rows"].tolist()


def test_reference_stats_equal_brute_force_varlen_chunk_and_float_mask():
    torch.manual_seed(16)
    h, e = 2, 4
    cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 5, 9])
    q, k = torch.randn(1, h, 7, e, dtype=torch.float64), torch.randn(1, h, 9, e, dtype=torch.float64)
    add = torch.randn(1, h, 7, 9, dtype=torch.float64)
    add[0, :, 1, 0] = -math.inf  # blocked
    add[0, :, 5, 6] = torch.finfo(torch.float64).min  # HF-style "min value" masking: blocked too
    got = reference_stats(
        q,
        k,
        causal=True,
        causal_align="bottom_right",
        chunk=2,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        attn_mask=add,
    )
    docs = [(0, 3, 0, 5), (3, 7, 5, 9)]

    def allowed(b_, h_, i, j):
        for q0, q1, k0, k1 in docs:
            if q0 <= i < q1:
                li, lj = i - q0, j - k0
                d = li + (k1 - k0) - (q1 - q0)
                in_doc = k0 <= j < k1
                return (
                    in_doc
                    and lj <= d
                    and lj // 2 == d // 2
                    and math.isfinite(add[0, h_, i, j])
                    and add[0, h_, i, j] > -1e300
                )
        return False

    want = brute_force_stats(q, k, allowed, bias_fn=lambda b_, h_, i, j: float(add[0, h_, i, j]))
    assert_stats_equal(got, want)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_reference_block_mask_and_score_mod_equal_brute_force_and_flex_attention():
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    torch.manual_seed(17)
    b, h, n, e = 1, 2, 16, 4
    doc = torch.tensor([0] * 3 + [1] * 9 + [2] * 4)  # blocks of 4: some full, some partial

    def doc_causal(b_, h_, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    def score_mod(score, b_, h_, q_idx, kv_idx):
        return score + 0.25 * (h_ + 1) * (q_idx - kv_idx)

    block_mask = create_block_mask(doc_causal, b, h, n, n, device="cpu", BLOCK_SIZE=4)
    assert block_mask.full_kv_num_blocks is not None and int(block_mask.full_kv_num_blocks.sum()) > 0
    q, k = torch.randn(b, h, n, e, dtype=torch.float64), torch.randn(b, h, n, e, dtype=torch.float64)
    got = reference_stats(q, k, block_mask=block_mask, score_mod=score_mod)
    want = brute_force_stats(
        q,
        k,
        lambda b_, h_, i, j: bool(doc[i] == doc[j]) and j <= i,
        score_fn=lambda s, b_, h_, i, j: s + 0.25 * (h_ + 1) * (i - j),
    )
    assert_stats_equal(got, want)
    # FlexAttention itself (eager, CPU, no grad): values = identity, so its output rows are the probabilities
    with torch.no_grad():
        probs = flex_attention(
            q,
            k,
            torch.eye(n, dtype=torch.float64).expand(b, h, n, n),
            score_mod=score_mod,
            block_mask=block_mask,
        )
    torch.testing.assert_close(probs, got["probs"], **TOL)
    # a BlockMask whose block lists disagree with its mask_mod: the reference follows the block lists
    # (what the compiled kernel computes); eager flex_attention would apply mask_mod everywhere instead
    diagonal_only = BlockMask.from_kv_blocks(
        torch.ones(1, 1, 2, dtype=torch.int32),
        torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32),
        BLOCK_SIZE=8,
    )
    allowed = reference_stats(q, k, block_mask=diagonal_only)["allowed"][0, 0]
    expected = torch.zeros(n, n, dtype=torch.bool)
    expected[:8, :8] = expected[8:, 8:] = True
    assert torch.equal(allowed, expected)


def test_reference_top_left_vs_bottom_right_and_empty_rows():
    q, k = torch.randn(1, 1, 4, 2, dtype=torch.float64), torch.randn(1, 1, 2, 2, dtype=torch.float64)
    top = reference_stats(q, k, causal=True)["allowed"][0, 0].int().tolist()
    bottom = reference_stats(q, k, causal=True, causal_align="bottom_right")
    assert top == [[1, 0], [1, 1], [1, 1], [1, 1]]
    assert bottom["allowed"][0, 0].int().tolist() == [
        [0, 0],
        [0, 0],
        [1, 0],
        [1, 1],
    ]  # flash-attn's docstring
    assert bottom["rows"].tolist() == [2]  # rows 0 and 1 see no key and are left out of the means
    assert bottom["probs"][0, 0, :2].eq(0).all() and math.isfinite(float(bottom["entropy"][0]))


# ------------------------------------------------------------------------------------------------
# Hugging Face's own flash-attention-2 path on the stand-in
# ------------------------------------------------------------------------------------------------


def test_hf_flash_attention_2_path_runs_on_the_standin(standins):
    from transformers import LlamaConfig, LlamaForCausalLM

    from .hf import hf_model_with_flash_standin

    config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
    )
    torch.manual_seed(18)
    model = hf_model_with_flash_standin(LlamaConfig, LlamaForCausalLM, **config)
    sdpa = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa"))
    sdpa.load_state_dict(model.state_dict())
    ids = torch.randint(0, 96, (2, 10))

    with FunctionSpy() as spy:
        out = model(ids, labels=ids)
        out.loss.backward()
    assert spy.ops == [("OpOverloadPacket", "flash_attn::_flash_attn_forward")] * 2  # one per layer
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, sdpa(ids).logits, atol=1e-5, rtol=1e-5)

    # packed batch: position_ids restart at 0 -> HF takes flash_attn_varlen_func, one document each
    packed = torch.randint(0, 96, (1, 10))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    with FunctionSpy() as spy:
        logits = model(packed, position_ids=position_ids).logits
        logits.sum().backward()
    assert spy.ops == [("OpOverloadPacket", "flash_attn::_flash_attn_varlen_forward")] * 2
    with torch.no_grad():
        separate = torch.cat([model(packed[:, a:z]).logits for a, z in ((0, 4), (4, 7), (7, 10))], dim=1)
    torch.testing.assert_close(logits.detach(), separate, atol=1e-5, rtol=1e-5)
