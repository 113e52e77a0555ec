"""timm vision Transformers (10 classes on 32x32 images), each with fused (SDPA) and non-fused attention.

timm's attention modules carry a ``fused_attn`` flag (set at construction from ``timm.layers.use_fused_attn``;
Swin's window attention defaults to non-fused): the builders set it on every module, so the
``-fused`` entries call ``F.scaled_dot_product_attention`` and the ``-eager`` ones ``q @ kᵀ`` + softmax.

timm imports ``torchvision.ops.misc.FrozenBatchNorm2d`` at import time. The torchvision wheel on the
registry is CUDA-linked and fails to import against the CPU torch (``operator torchvision::nms does
not exist``) — and once installed it breaks ``transformers`` too, which imports torchvision whenever it
is installed. So CI installs timm with ``--no-deps`` (no torchvision), and `_import_timm` serves
placeholder ``torchvision.*`` modules while ``import timm`` runs, then removes them from
``sys.modules`` (timm needs torchvision only for its data pipeline and FrozenBatchNorm2d, which the zoo's
models never use; transformers never sees the placeholders: it asks the installed distributions).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from .base import BATCH, ZooModel, finish, require, token_ce

BUILDERS: dict[str, Callable[[], ZooModel]] = {}
N_CLASSES = 10
_INSTALL = "pip install -c constraints-zoo.txt --no-deps timm"


class _Placeholder(type):
    """Stand-in for any torchvision class, constant or function: attributes are placeholders too."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(attr, (), {"__module__": cls.__module__})


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(attr, (), {"__module__": self.__name__})


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves placeholder modules for ``torchvision`` and every ``torchvision.*`` import."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def _import_timm() -> Any:
    if "timm" in sys.modules or importlib.util.find_spec("timm") is None:
        return require("timm", _INSTALL)  # already imported, or the zoo's ImportError
    if importlib.util.find_spec("torchvision") is not None:
        try:
            return require("timm", _INSTALL)
        except RuntimeError as exc:  # e.g. a CUDA-linked torchvision against the CPU torch
            raise ImportError(f"timm: torchvision is installed but does not import: {exc}") from exc
    stub = _TorchvisionStub()
    sys.meta_path.insert(0, stub)
    try:
        return require("timm", _INSTALL)
    finally:
        sys.meta_path.remove(stub)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


def _set_fused(model: nn.Module, fused: bool) -> int:
    """Set ``fused_attn`` on every timm attention module; returns how many there are."""
    n = 0
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused
            n += 1
    return n


def _classifier(make: Callable[[Any], nn.Module], fused: bool, n_calls: int, notes: str) -> ZooModel:
    timm = _import_timm()
    torch.manual_seed(0)
    model = finish(make(timm))
    if _set_fused(model, fused) != n_calls:
        raise AssertionError(f"expected {n_calls} timm attention modules")
    images = torch.randn(BATCH, 3, 32, 32)
    ce = token_ce(torch.randint(0, N_CLASSES, (BATCH,)))
    return ZooModel(
        model=model,
        inputs={},
        args=(images,),
        loss_fn=ce,
        logits_fn=lambda out: out,
        n_attention_calls=n_calls,
        notes=f"{notes}; attn={'fused sdpa' if fused else 'eager q@k softmax'}",
        n_classes=N_CLASSES,
    )


def _vit(timm: Any) -> nn.Module:
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        num_classes=N_CLASSES,
        drop_path_rate=0.0,
    )


def _swin(timm: Any) -> nn.Module:
    return timm.models.swin_transformer.SwinTransformer(
        img_size=32,
        patch_size=4,
        embed_dim=16,
        depths=(2, 1),
        num_heads=(2, 4),
        window_size=2,
        mlp_ratio=2.0,
        num_classes=N_CLASSES,
        drop_path_rate=0.0,  # timm's default is 0.1 (stochastic depth)
    )


for _fused in (True, False):
    _suffix = "fused" if _fused else "eager"
    BUILDERS[f"timm-vit-{_suffix}"] = partial(
        _classifier,
        _vit,
        _fused,
        2,
        "ViT: fused qkv Linear (contiguous q|k|v), pre-norm, CLS token, 17 tokens",
    )
    BUILDERS[f"timm-swin-{_suffix}"] = partial(
        _classifier,
        _swin,
        _fused,
        3,
        "Swin: nested stages (depths 2, 1) of window attention (window 2, shift in the 2nd block), relative "
        "position bias (+ shift mask) in the softmax input (eager) or the float attn_mask (fused), patch merging",
    )
