"""Interventions through flash-attn 2 and 3 change forward *and* backward (docs/guide/kernels.md).

flash-attn's entry points hand q, k, v and ``softcap`` to an ``autograd.Function`` that saves the q and k
it was given and keeps its own ``ctx.softcap`` for the backward (flash-attn 2.8.4
``flash_attn/flash_attn_interface.py``; ``hopper/flash_attn_interface.py``; the stand-ins in
``tests/standins/packages`` mirror that structure). A change made to the forward op inside that Function
reaches the forward only. stabkit changes the call at the entry point, where autograd sees it — so for
every entry point the soft-capped (``attn_softcap``) and q/k-normalised (``qk_norm``) model must have the
gradients of the same model passing the cap to the kernel itself, or normalising q and k itself — and
refuses by name a change its backward would not see.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from standins import installed
from torch import nn

from stabkit.interventions import InterventionError, apply

torch.set_num_threads(1)
D, H, KV, SEQ, VOCAB = 32, 4, 2, 9, 50
HD = D // H
CAP, EPS = 0.7, 1e-6


def _call(entry: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """Call flash-attn entry point `entry` ('fa2:<name>' or 'fa3:<name>') on (B, T, H, hd) q and
    (B, T, KV, hd) k, v, packing and flattening as the entry point wants; (B, T, H, hd) out."""
    import flash_attn
    import flash_attn_interface as fa3

    lib, name = entry.split(":")
    if lib == "te":
        return _call_te(name, q, k, v)
    mod = flash_attn if lib == "fa2" else fa3
    fn = getattr(mod, name)
    b, t = q.shape[:2]
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
    flat = lambda x: x.flatten(0, 1)  # noqa: E731
    rep = lambda x: x.repeat_interleave(H // KV, dim=2)  # noqa: E731  (packed qkv: as many heads)
    if name == "flash_attn_func":
        return fn(q, k, v, causal=True, **kw)
    if name == "flash_attn_kvpacked_func":
        return fn(q, torch.stack([k, v], dim=2), causal=True, **kw)
    if name == "flash_attn_qkvpacked_func":
        return fn(torch.stack([q, rep(k), rep(v)], dim=2), causal=True, **kw)
    if name == "flash_attn_varlen_func":
        return fn(flat(q), flat(k), flat(v), cu, cu, t, t, causal=True, **kw).view(b, t, H, HD)
    if name == "flash_attn_varlen_kvpacked_func":
        kv = torch.stack([flat(k), flat(v)], dim=1)
        return fn(flat(q), kv, cu, cu, t, t, causal=True, **kw).view(b, t, H, HD)
    if name == "flash_attn_varlen_qkvpacked_func":
        qkv = torch.stack([flat(q), flat(rep(k)), flat(rep(v))], dim=1)
        return fn(qkv, cu, t, causal=True, **kw).view(b, t, H, HD)
    raise AssertionError(entry)


def _call_te(how: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's DotProductAttention (bshd, causal) called with separate q, k, v ('layers'),
    or with the packed ``qkv_layer`` and no query_layer as its MultiheadAttention does ('qkv_layer')."""
    from transformer_engine.pytorch import DotProductAttention

    b, t = q.shape[:2]
    heads = H if how == "qkv_layer" else KV
    core = DotProductAttention(H, HD, num_gqa_groups=heads, qkv_format="bshd", attn_mask_type="causal")
    if how == "qkv_layer":
        rep = lambda x: x.repeat_interleave(H // KV, dim=2)  # noqa: E731
        out = core(None, None, None, qkv_layer=torch.stack([q, rep(k), rep(v)], dim=2), qkv_interleave_dim=-3)
    else:
        out = core(q, k, v)
    return out.view(b, t, H, HD)


TE_ENTRIES = ["te:layers", "te:qkv_layer"]
"""Transformer Engine has no soft-cap argument: ``qk_norm`` only."""
ENTRIES = [
    *(
        f"fa2:{n}"
        for n in (
            "flash_attn_func",
            "flash_attn_kvpacked_func",
            "flash_attn_qkvpacked_func",
            "flash_attn_varlen_func",
            "flash_attn_varlen_kvpacked_func",
            "flash_attn_varlen_qkvpacked_func",
        )
    ),
    "fa3:flash_attn_func",
    "fa3:flash_attn_qkvpacked_func",
]


class Attention(nn.Module):
    """q and k each from two projections (half the head dim each, as MLA's "nope" and "rope" parts),
    so ``qk_norm`` can only normalise them at the kernel call. `own` = 'cap' passes the soft cap to
    the kernel itself, 'norm' normalises q and k itself (the references)."""

    def __init__(self, entry: str, own: str = "") -> None:
        super().__init__()
        self.entry, self.own = entry, own
        half = lambda out: nn.Linear(D, out, bias=False)  # noqa: E731
        self.q_a, self.q_b = half(H * HD // 2), half(H * HD // 2)
        self.k_a, self.k_b = half(KV * HD // 2), half(KV * HD // 2)
        self.v, self.o = nn.Linear(D, KV * HD, bias=False), nn.Linear(D, D, bias=False)
        if own == "norm":
            self.q_gain, self.k_gain = nn.Parameter(torch.ones(HD)), nn.Parameter(torch.ones(HD))
        self.direct = False
        """Call ``FlashAttnFunc.apply`` (flash-attn 2's autograd Function) instead of the entry point."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = torch.cat([self.q_a(x).view(b, t, H, -1), self.q_b(x).view(b, t, H, -1)], -1)
        k = torch.cat([self.k_a(x).view(b, t, KV, -1), self.k_b(x).view(b, t, KV, -1)], -1)
        v = self.v(x).view(b, t, KV, HD)
        if self.own == "norm":
            q = F.rms_norm(q, (HD,), self.q_gain, EPS)
            k = F.rms_norm(k, (HD,), self.k_gain, EPS)
        kw = {"softcap": CAP} if self.own == "cap" else {}
        if self.direct:
            from flash_attn.flash_attn_interface import FlashAttnFunc

            y = FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False, True)
        else:
            y = _call(self.entry, q, k, v, **kw)
        return self.o(y.reshape(b, t, D))


class LM(nn.Module):
    def __init__(self, entry: str, own: str = "") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(D), "attn": Attention(entry, own)}) for _ in range(2)
        )
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block["attn"](block["ln"](x))
        return self.head(x)


def _pair(entry: str, own: str) -> tuple[LM, LM]:
    """(a plain model, its reference with `own`), same weights, in float64."""
    torch.manual_seed(0)
    plain = LM(entry).double()
    torch.manual_seed(0)
    ref = LM(entry, own).double()
    ref.load_state_dict(plain.state_dict(), strict=False)
    return plain, ref


def _grads(model: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rename: Callable[[str], str]
) -> None:
    assert {rename(n) for n in got} == set(want), (sorted(got), sorted(want))
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[rename(name)], rtol=1e-5, atol=1e-9, msg=name)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("entry", ENTRIES)
def test_attn_softcap_through_flash_attn_has_the_gradients_of_the_kernel_capping_itself(entry: str) -> None:
    with installed():
        model, ref = _pair(entry, "cap")
        handle = apply(model, "attn_softcap", cap=CAP)
        idx = _batch()
        loss, grads = _grads(model, idx)
        want_loss, want = _grads(ref, idx)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=0)
        _assert_same(grads, want, lambda n: n)
        handle.remove()
        plain_loss, _ = _grads(model, idx)
        assert not torch.allclose(plain_loss, want_loss)  # the cap is not a no-op at this scale


@pytest.mark.parametrize("entry", [*ENTRIES, *TE_ENTRIES])
def test_qk_norm_through_flash_attn_has_the_gradients_of_normalising_q_and_k_first(entry: str) -> None:
    with installed():
        model, ref = _pair(entry, "norm")
        handle = apply(model, "qk_norm", eps=EPS)
        assert len(handle.new_parameters()) == 4  # a q and a k gain per attention module
        idx = _batch()
        loss, grads = _grads(model, idx)
        want_loss, want = _grads(ref, idx)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=0)

        def rename(name: str) -> str:  # blocks.0.attn.stabkit_qk_norm.q.weight -> blocks.0.attn.q_gain
            for which in ("q", "k"):
                name = name.replace(f"stabkit_qk_norm.{which}.weight", f"{which}_gain")
            return name

        _assert_same(grads, want, rename)
        handle.remove()


def test_a_change_inside_flash_attns_autograd_function_is_refused_by_name() -> None:
    """Code that calls ``FlashAttnFunc.apply`` itself (ring attention does) reaches only the forward op:
    ``attn_softcap`` is refused at apply; switched to that path later, the call runs unchanged (a warning
    names why) and the model trains with the plain model's gradients, not capped-forward-only ones."""
    entry = "fa2:flash_attn_func"
    with installed():
        model, _ = _pair(entry, "cap")
        plain, _ = _pair(entry, "cap")
        for block in model.blocks:
            block["attn"].direct = True
        with pytest.raises(InterventionError, match="autograd Function"):
            apply(model, "attn_softcap", cap=CAP)
        for block in model.blocks:
            block["attn"].direct = False
        handle = apply(model, "attn_softcap", cap=CAP)
        for block in (*model.blocks, *plain.blocks):
            block["attn"].direct = True
        idx = _batch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = _grads(model, idx)
        said = [str(w.message) for w in caught if "left unchanged" in str(w.message)]
        assert len(said) == 2 and all("autograd Function" in s for s in said), said
        want_loss, want = _grads(plain, idx)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=0)
        _assert_same(grads, want, lambda n: n)
        assert handle.refused.keys() == {"blocks.0.attn", "blocks.1.attn"}
        handle.remove()


def test_flash_attn_soft_cap_with_attention_dropout_is_refused_with_flash_attns_reason() -> None:
    """flash-attn raises 'Softcapping does not support dropout' (the stand-ins cannot run dropout at
    all): stabkit's cap rewrite refuses first, so the call runs unchanged and apply names the reason."""
    from stabkit.attention import kernels

    for name in ("flash_attn", "flash_attn_3"):
        rewrite = kernels.KERNELS[name].cap
        assert rewrite is not None
        arguments: dict[str, Any] = {"dropout_p": 0.1, "softcap": 0.0}
        with pytest.raises(ValueError, match="Softcapping does not support dropout"):
            rewrite(arguments, CAP)
        assert arguments["softcap"] == 0.0  # refused before anything changed
        rewrite(arguments := {"dropout_p": 0.0, "softcap": 0.0}, CAP)
        assert arguments["softcap"] == CAP
