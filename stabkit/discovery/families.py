"""What stabkit knows about particular model families: block wiring, norm placement, attention impl.

Runs once at discovery time. The generic rules in `roles` find the modules; a family adds the
facts names cannot tell (where the norms sit, how attention is computed).
"""

from __future__ import annotations

from torch import nn

from .modelmap import NormMap
from .roles import block_norms, child, norm_kind


def family_of(block: nn.Module) -> str:
    """Name the family of a block module: 'stabkit-gpt', 'torch-encoder', 'hf-gpt2', 'hf-llama', 'nanogpt' or 'fallback'."""
    from ..harness.models.gpt import Block

    if isinstance(block, Block):
        return "stabkit-gpt"
    if isinstance(block, nn.TransformerEncoderLayer):
        return "torch-encoder"
    if type(block).__name__ == "GPT2Block":
        return "hf-gpt2"
    attn = getattr(block, "self_attn", None)
    if (
        attn is not None
        and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and hasattr(block, "input_layernorm")
        and hasattr(block, "post_attention_layernorm")
    ):
        return "hf-llama"
    attn = getattr(block, "attn", None)
    if (
        attn is not None
        and isinstance(getattr(attn, "c_attn", None), nn.Linear)
        and hasattr(block, "ln_1")
        and hasattr(block, "ln_2")
    ):
        return "nanogpt"
    return "fallback"


def attention_impl(family: str, attn: nn.Module) -> str:
    """How the family's attention module computes attention."""
    if family == "stabkit-gpt":
        return "eager" if getattr(attn, "softcap", None) is not None else "sdpa"
    if family.startswith("hf-"):
        impl = getattr(getattr(attn, "config", None), "_attn_implementation", None) or "eager"
        return f"hf:{impl}"
    if family == "nanogpt":
        return "sdpa" if getattr(attn, "flash", False) else "eager"
    if isinstance(attn, nn.MultiheadAttention):
        return "torch_mha"
    return "unknown"


def mlp_path(family: str, block: nn.Module) -> str | None:
    """Relative path of the module whose output is the block's MLP output."""
    if family == "torch-encoder" or isinstance(block, nn.TransformerDecoderLayer):
        return "linear2"
    return child(block, ("mlp", "ffn", "feed_forward", "ff", "mlp_block", "feedforward", "fc"))


def norms_and_placement(family: str, block: nn.Module, prefix: str) -> tuple[list[NormMap], str, bool]:
    """The block's norms, its placement ('pre' | 'post' | 'sandwich' | 'unknown'), and whether it was guessed."""
    if family == "stabkit-gpt":
        placement = str(getattr(block, "placement", "pre"))
        first = "post" if placement == "post" else "pre"
        norms = [
            NormMap(f"{prefix}.norm1", norm_kind(block.get_submodule("norm1")), "attn", first),
            NormMap(f"{prefix}.norm2", norm_kind(block.get_submodule("norm2")), "mlp", first),
        ]
        for name, sub in (("post_norm1", "attn"), ("post_norm2", "mlp")):
            mod = getattr(block, name, None)
            if mod is not None:
                norms.append(NormMap(f"{prefix}.{name}", norm_kind(mod), sub, "sandwich"))
        return norms, placement, False
    if family == "torch-encoder":
        placement = "pre" if getattr(block, "norm_first", False) else "post"
        return block_norms(block, prefix, placement), placement, False
    if family in ("hf-gpt2", "hf-llama", "nanogpt"):
        return block_norms(block, prefix, "pre"), "pre", False
    norms = block_norms(block, prefix, "pre")
    return norms, ("pre" if norms else "unknown"), True
