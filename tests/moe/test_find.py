"""Discovery finds every MoE layer of the zoo's MoE models by behaviour, with E, k and where the routing
is read (`stabkit.moe.find`), and a router it cannot see once registered (`stabkit.moe.registry`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from zoo import reference_gpt

import stabkit
from stabkit.moe import register_router, unregister_router

from .tiny import MODELS, build, tokens


def moe_map(model: nn.Module) -> list[stabkit.moe.MoEMap]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stabkit.inspect_model(model, example=tokens()).moe


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_moe_layer_is_found_without_hints(name: str) -> None:
    *_, n_layers, n_experts, top_k = MODELS[name]
    model = build(name)
    found = moe_map(model)
    assert len(found) == n_layers
    modules = dict(model.named_modules())
    for moe in found:
        assert (moe.n_experts, moe.top_k, moe.found) == (n_experts, top_k, "traced")
        assert moe.gate_weight is not None
        weight = dict(model.named_parameters())[moe.gate_weight]
        assert n_experts in weight.shape  # the gate's (E, d) matrix
        assert moe.router in modules and moe.path in modules and moe.experts in modules
        assert moe.logits is not None
        # the router was really called with the layer's input and its logits are (T, E)
        assert moe.router.startswith(moe.path)


def test_the_details_of_each_router() -> None:
    ds = moe_map(build("deepseek-v3"))[0]
    assert ds.scoring == "sigmoid" and ds.grouped
    assert ds.score_bias == f"{ds.router}.e_score_correction_bias"
    assert ds.shared_experts == [f"{ds.path}.shared_experts"]
    assert ds.indices is not None and ds.indices.key == 2 and ds.logits is not None and ds.logits.key == 0
    mixtral = moe_map(build("mixtral"))[0]
    assert (mixtral.scoring, mixtral.score_bias, mixtral.grouped, mixtral.shared_experts) == (
        "softmax",
        None,
        False,
        [],
    )
    assert mixtral.experts == f"{mixtral.path}.experts"
    qwen = moe_map(build("qwen2-moe"))[0]
    assert qwen.shared_experts == [f"{qwen.path}.shared_expert"]  # not its 1-output shared_expert_gate
    for name in ("gpt-oss", "granitemoe"):
        assert moe_map(build(name))[0].scoring == "logits"  # top-k on the logits, softmax after
    llama = moe_map(build("llama4"))[0]
    assert llama.scoring == "logits" and llama.indices is None  # it returns (scores, logits): recomputed
    assert llama.logits is not None and llama.logits.key == 1
    assert llama.experts == f"{llama.path}.experts" and llama.shared_experts == [
        f"{llama.path}.shared_expert"
    ]


def test_a_dense_model_has_no_moe_layer() -> None:
    mmap = stabkit.inspect_model(reference_gpt())
    assert mmap.moe == [] and "moe" not in mmap.found


def test_inspect_describes_the_moe_layers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = stabkit.inspect_model(build("mixtral"), example=tokens()).describe()
    assert "moe: model.layers.1.mlp  router=model.layers.1.mlp.gate" in text and "E=4 k=2 (softmax)" in text


class SortRouter(nn.Module):
    """A router that picks with argsort (no topk): discovery cannot see its choice."""

    def __init__(self, d: int, e: int, k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.n, self.k = e, k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        return logits, logits.argsort(-1, descending=True)[..., : self.k]


class SortMoE(nn.Module):
    def __init__(self, d: int = 8, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router = SortRouter(d, e, k)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, idx = self.router(x)
        w = logits.softmax(-1).gather(-1, idx)
        outs = torch.stack([f(x) for f in self.experts], -2)  # (B, T, E, d)
        picked = outs.gather(-2, idx[..., None].expand(*idx.shape, x.shape[-1]))
        return x + (w[..., None] * picked).sum(-2)


def test_a_registered_router_is_mapped() -> None:
    model = nn.Sequential(SortMoE(), SortMoE())
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert stabkit.inspect_model(model, example=x).moe == []
        register_router(SortRouter, n_experts="n", top_k="k", logits=0, indices=1)
        try:
            found = stabkit.inspect_model(model, example=(x * 1.0,)).moe
        finally:
            unregister_router(SortRouter)
    assert [(m.path, m.router, m.n_experts, m.top_k, m.found) for m in found] == [
        ("0", "0.router", 4, 2, "registered"),
        ("1", "1.router", 4, 2, "registered"),
    ]
    with pytest.raises(ValueError, match="scoring"):
        register_router(SortRouter, n_experts=4, top_k=2, scoring="tanh")  # type: ignore[arg-type]
