"""An intervention on a model's returned logits says once per application that the model's own loss misses it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stabkit.interventions import apply


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TiedLM(nn.Module):
    """Logits from the embedding matrix inside forward (no head module), loss computed inside too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = h + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        logits = F.linear(h, self.emb.weight)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Output(loss, logits)


def _said(model: nn.Module, x: torch.Tensor, labels: torch.Tensor | None, times: int) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            model(x, labels)
    return sum("does not include it" in str(w.message) for w in caught)


def test_said_once_per_application_and_only_when_the_model_made_a_loss() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    x = torch.randint(0, 32, (2, 6))
    for name in ("z_loss", "logit_softcap"):
        handle = apply(model, name, example=x)
        assert _said(model, x, None, 2) == 0  # no loss of its own: nothing to say
        assert _said(model, x, x, 3) == 1
        handle.remove()
        handle = apply(model, name, example=x)  # a new application says it again
        assert _said(model, x, x, 2) == 1
        handle.remove()
