"""A tiny Llama-3-style decoder with torchtitan's module names, and torchtitan's tensor-parallel plan.

The model mirrors ``torchtitan.models.llama3.model`` (``tok_embeddings``, ``layers`` as a ModuleDict,
``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``,
``output``; grouped-query attention through SDPA; rotary embeddings passed to each block), small
enough for CPU processes. `apply_tp` is torchtitan's ``apply_tp`` (``torchtitan/models/llama3/
infra/parallelize.py``): q/k/v and the MLP's up/gate colwise, o and the MLP's down rowwise, and with
``sequence_parallel`` the norms under `SequenceParallel` (the residual stream sharded over the
sequence); `apply_fsdp` shards every block and the root with FSDP2 on the data-parallel mesh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ = 16
DIM = 32
HEADS = 4
KV_HEADS = 2
LAYERS = 2


def rope_table(head_dim: int, seq: int) -> torch.Tensor:
    """(seq, head_dim // 2, 2) cosines and sines of the rotary angles."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, T, H, hd) by table (T, hd // 2, 2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, hd/2) each
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1: the local number of heads under tensor parallelism (torchtitan does the same)
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = rotate(xq, rope), rotate(xk, rope)
        xk = xk.repeat_interleave(self.n_rep, dim=2)
        xv = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, 2 * dim)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class FlatBlock(nn.Module):
    """A block that holds its MLP's projections directly (``w1``, ``w2``, ``w3``), no MLP module."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Transformer(nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = DIM,
        n_layers: int = LAYERS,
        n_heads: int = HEADS,
        n_kv_heads: int = KV_HEADS,
        flat: bool = False,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("rope", rope_table(dim // n_heads, SEQ), persistent=False)
        block = FlatBlock if flat else TransformerBlock
        self.layers = nn.ModuleDict({str(i): block(dim, n_heads, n_kv_heads) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def make_model(seed: int = 0, flat: bool = False) -> Transformer:
    """The same weights on every process (`flat`: blocks hold w1, w2, w3 directly, `FlatBlock`)."""
    torch.manual_seed(seed)
    return Transformer(flat=flat)


def apply_tp(
    model: Transformer, tp_mesh: object, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    """torchtitan's tensor-parallel plan (``apply_tp``; no float8, no async TP). With `loss_parallel`
    the logits stay a DTensor sharded over the vocabulary (the loss then under
    ``torch.distributed.tensor.parallel.loss_parallel()``), as torchtitan does by default."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)  # type: ignore[arg-type]
    for block in model.layers.values():
        flat = isinstance(block, FlatBlock)
        mlp = "" if flat else "feed_forward."
        plan: dict = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            f"{mlp}w1": ColwiseParallel(input_layouts=seq if flat else Replicate()),
            f"{mlp}w2": RowwiseParallel(output_layouts=seq),
            f"{mlp}w3": ColwiseParallel(input_layouts=seq if flat else Replicate()),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan["ffn_norm"] = SequenceParallel()
            if not flat:
                plan["feed_forward"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def apply_tp_hf(model: nn.Module, tp_mesh: object) -> None:
    """The same plan on a Hugging Face ``LlamaForCausalLM`` (`tests/zoo.py`'s ``hf_llama``), without
    sequence parallel: q/k/v, gate and up colwise, o and down rowwise, the vocabulary sharded."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, root)  # type: ignore[arg-type]
    for layer in model.model.layers:  # type: ignore[union-attr]
        plan = {
            **dict.fromkeys(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ColwiseParallel()),
            **dict.fromkeys(("mlp.gate_proj", "mlp.up_proj"), ColwiseParallel()),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        parallelize_module(layer, tp_mesh, plan)  # type: ignore[arg-type]


def apply_fsdp(model: Transformer, dp_mesh: object) -> None:
    """FSDP2 on every block and on the root, over the data-parallel mesh (torchtitan's ``apply_fsdp``)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=dp_mesh)  # type: ignore[arg-type]
