"""Weight inits of the healthy-run corpus, applied once to a freshly built model (before the optimizer).

- ``native``: what the family's constructor did (PyTorch's default for `TinyGPT` and the encoder, the
  Hugging Face init for GPT-2/Llama/Qwen2-MoE, Wortsman et al. for the reference GPT);
- ``torch``: every module's own ``reset_parameters`` (PyTorch's default: Kaiming-uniform linears,
  N(0, 1) embeddings);
- ``scaled``: GPT-2 style N(0, 0.02), residual output projections ×1/√(2L);
- ``mup``: μP-style: embeddings N(0, 1), hidden matrices N(0, 1/fan_in), a zero readout; the
  optimizer side (hidden learning rates ×base/width) is `optim.param_groups`.
"""

from __future__ import annotations

import math

from torch import nn

INITS: tuple[str, ...] = ("native", "torch", "scaled", "mup")

RESIDUAL_OUT = ("o_proj", "out", "proj", "c_proj", "down_proj", "out_proj", "linear2")
"""Last name parts of the projections that write into the residual stream."""

READOUT = ("head", "lm_head")


def apply_init(model: nn.Module, init: str, layers: int) -> None:
    """Re-initialise `model` in place by `init` (one of `INITS`)."""
    if init == "native":
        return
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if init == "torch":
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and not list(module.children()):
                reset()
            continue
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02 if init == "scaled" else 1.0)
        elif isinstance(module, nn.Linear):
            if last in READOUT and init == "mup":
                nn.init.zeros_(module.weight)
            elif init == "scaled":
                std = 0.02 / math.sqrt(2 * layers) if last in RESIDUAL_OUT else 0.02
                nn.init.normal_(module.weight, std=std)
            else:
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.weight.shape[1]))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
