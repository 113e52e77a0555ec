"""What every audit rule reads: the model, its ModelMap, the optimizer and the run settings.

Built once per `stabkit.audit` call. It indexes modules and parameters by path; it never
reads tensor values (rules that want a value check `is_meta` first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from ..discovery import BlockMap, ModelMap
from ..discovery.roles import is_norm

CONFIG_NAMES = ("config", "cfg")
ACTIVE_ATTR = "_stabkit_interventions"
"""Where `stabkit.interventions` records what is applied to a model (name -> handle, in `model.__dict__`)."""


def applied_interventions(model: nn.Module) -> frozenset[str]:
    """Names of the stabkit interventions currently applied to `model`."""
    return frozenset(model.__dict__.get(ACTIVE_ATTR, {}) or {})


@dataclass
class AuditContext:
    """Inputs of one audit, with lookups shared by the rules."""

    model: nn.Module
    mmap: ModelMap
    optimizer: torch.optim.Optimizer | None = None
    lr: float | None = None
    """Peak learning rate the run will use (None: read from the optimizer's param groups)."""
    warmup_steps: int | None = None
    """Warmup steps the run will use (None: unknown, treated as no warmup)."""
    seq_len: int | None = None
    """Sequence length for the KV-cache figure (None: the model's context length)."""
    active: frozenset[str] = field(default_factory=frozenset)
    """Interventions the user says are active (e.g. 'z_loss' inside their own loss)."""
    kv_dtype: torch.dtype | None = None
    """dtype of the KV cache (None: the dtype of the key projection weight)."""

    @cached_property
    def modules(self) -> dict[str, nn.Module]:
        """Every module by its `named_modules()` path."""
        return dict(self.model.named_modules())

    @cached_property
    def is_meta(self) -> bool:
        """True when parameters live on the meta device (no values: rules read shapes and flags only)."""
        return any(p.is_meta for p in self.model.parameters())

    @cached_property
    def param_names(self) -> dict[int, list[str]]:
        """id(parameter) -> every name it has in the model (tied weights have several)."""
        names: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return names

    @cached_property
    def configs(self) -> list[Any]:
        """Config objects of the model and of its attention modules (HF, reference GPT), deduplicated."""
        found: list[Any] = []
        owners = [self.model] + [self.modules[a] for a in self.mmap.attention_paths if a in self.modules]
        for owner in owners:
            for attr in CONFIG_NAMES:
                cfg = getattr(owner, attr, None)
                if cfg is not None and not isinstance(cfg, nn.Module) and all(cfg is not c for c in found):
                    found.append(cfg)
        return found

    def config_value(self, *names: str) -> tuple[str, Any] | None:
        """The first (name, value) among `names` set (not None) on any config object."""
        for cfg in self.configs:
            for n in names:
                value = getattr(cfg, n, None)
                if value is not None:
                    return n, value
        return None

    def module(self, path: str | None) -> nn.Module | None:
        """The module at `path`, or None."""
        return self.modules.get(path) if path else None

    def owner_path(self, param_name: str) -> str:
        """Module path that owns a parameter name ('' for the root)."""
        return param_name.rsplit(".", 1)[0] if "." in param_name else ""

    def is_norm_path(self, path: str) -> bool:
        """True when the module at `path` is a normalisation layer."""
        mod = self.modules.get(path)
        return mod is not None and is_norm(mod)

    def block(self, path: str) -> BlockMap | None:
        """The BlockMap that contains `path`."""
        bpath = self.mmap.block_of(path)
        return next((b for b in self.mmap.blocks if b.path == bpath), None)

    def context_length(self) -> int | None:
        """The model's maximum sequence length from its config, if it says."""
        hit = self.config_value("context", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
        return int(hit[1]) if hit and isinstance(hit[1], int) else None
