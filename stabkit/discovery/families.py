"""What stabkit knows about particular model families: block wiring, norm placement, attention impl.

Runs once at discovery time. The generic rules in `roles` find the modules; a family adds the
facts names cannot tell (where the norms sit, how attention is computed).

A model's classes may *declare* their family, so stabkit needs no import of them: a block or
attention module class with a class attribute ``stabkit_family = "<family>"`` (`FAMILY_ATTR`, one
of `FAMILIES`) is taken to be of that family (subclasses inherit it). The reference GPT
(``stabkit.harness.models``) declares `STABKIT_GPT` on its ``Block`` and ``Attention``, and so
promises their layout: a block with ``norm1``, ``norm2``, optional ``post_norm1``/``post_norm2``
and ``placement`` ('pre' | 'post' | 'sandwich'); an attention module with ``q_norm``/``k_norm``
slots (None or a norm over the head dim, applied to q and k (B, H, T, hd) before RoPE) and its
own ``softcap`` (None or the cap). Other families are recognised by their structure below.
"""

from __future__ import annotations

from torch import nn

from .modelmap import NormMap
from .roles import block_norms, child, norm_kind

FAMILY_ATTR = "stabkit_family"
"""The class attribute a block or attention module class sets to declare its family."""
STABKIT_GPT = "stabkit-gpt"
"""The family of the reference GPT (``stabkit.harness.models``), declared by its classes."""
FAMILIES = (STABKIT_GPT, "torch-encoder", "hf-gpt2", "hf-llama", "nanogpt")
"""The families stabkit knows; a declaration naming anything else is ignored."""


def declared_family(module: nn.Module) -> str | None:
    """The family `module`'s class declares (class attribute `FAMILY_ATTR`, one of `FAMILIES`), else None."""
    value = getattr(type(module), FAMILY_ATTR, None)
    return value if isinstance(value, str) and value in FAMILIES else None


def family_of(block: nn.Module) -> str:
    """Name the family of a block module: 'stabkit-gpt', 'torch-encoder', 'hf-gpt2', 'hf-llama', 'nanogpt' or 'fallback'.

    A declared family (`declared_family`) wins; otherwise the block's class and structure decide.
    """
    declared = declared_family(block)
    if declared is not None:
        return declared
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
    if family == STABKIT_GPT:
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
    if family == STABKIT_GPT:
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
