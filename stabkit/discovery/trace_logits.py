"""Find the final logits in a traced forward: the model output computed by a projection after the
last block (after any scale or cap the model applies), or — for a model whose forward returns only
its loss — the projection that feeds that loss; contrastive models' similarity logits
(``logits_per_image``).

Runs once at discovery time, from `trace_map.map_from_trace` (and `logits_from_trace` for z_loss /
logit_softcap on a model without attention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .modelmap import LogitsMap, ModelMap
from .roles import is_norm
from .trace import Trace
from .trace_builder import TraceBuilder


def find_logits(output: Any) -> tuple[Any, str | int | None]:
    """The logits tensor in a model output and how to take it: (tensor, key). A model output without
    ``logits`` takes the first ``logits*`` entry (CLIP's ``logits_per_image``)."""
    if isinstance(output, torch.Tensor):
        return output, None
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits, "logits"
    if isinstance(output, dict):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"], "logits"
        for key, value in output.items():
            if str(key).startswith("logits") and isinstance(value, torch.Tensor) and value.dim() >= 2:
                return value, str(key)
    if isinstance(output, tuple | list):
        for i, v in enumerate(output):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
                return v, i
    return None, None


def logits_from_trace(model: nn.Module, trace: Trace) -> ModelMap:
    """A map holding only the final logits (for z_loss / logit_softcap when no attention is found)."""
    mmap = ModelMap(family="traced", blocks=[])
    find_final_logits(TraceBuilder(model, trace), mmap)
    return mmap


def _loss_head(b: TraceBuilder, loss: torch.Tensor, last_end: int) -> tuple[str, int] | None:
    """(head module, vocabulary) of a loss-only model: the last projection after the blocks, feeding
    the loss, whose output is a module's output (the head the logits can be read from)."""
    t = b.trace
    upstream = t.ancestors(id(loss), since=last_end)
    for proj in reversed([p for p in t.projections if p.index >= last_end and p.output in upstream]):
        shape = t.shapes.get(proj.output, ())
        module = b.module_output_of(proj)
        if module is not None and len(shape) >= 2 and shape[-1] > 1:
            return module, int(shape[-1])
    return None


def find_final_logits(b: TraceBuilder, mmap: ModelMap) -> None:
    """Fill `mmap.logits`, `output_head`, `vocab_size` and `final_norm` from the trace."""
    t = b.trace
    tensor, key = find_logits(t.output)
    if tensor is None:
        loss = getattr(t.output, "loss", None)
        tensor = loss if isinstance(loss, torch.Tensor) else None
        if tensor is None:
            return
    last_end = b.window(mmap.blocks[-1].path)[1] if mmap.blocks else 0
    if tensor.dim() == 0:  # the forward returned only its loss
        found = _loss_head(b, tensor, last_end)
        if found is None:
            mmap.notes.append(
                "the model returns only a loss, and no head module feeds it: no logits/ statistics"
            )
            return
        mmap.output_head, mmap.vocab_size = found
        mmap.logits = LogitsMap(found[0], None, "traced")
        mmap.notes.append(
            f"the model returns only a loss: logits read at the head that feeds it ({found[0]})"
        )
        mmap.found["logits"] = "traced"
        return
    upstream = t.ancestors(id(tensor), since=last_end)
    heads = [p for p in t.projections if p.index >= last_end and p.output in upstream]
    if not heads:
        return
    head = heads[-1]
    head_module = b.module_output_of(head)
    mmap.output_head = head_module
    mmap.vocab_size = int(tensor.shape[-1])
    call = b.calls_by_output.get(id(tensor))
    if head_module is not None and call is not None and call.path == head_module:
        mmap.logits = LogitsMap(head_module, None, "traced")
    else:
        mmap.logits = LogitsMap("", key, "traced")
    norms = [
        m.path
        for m in t.modules
        if m.start >= last_end
        and m.end <= head.index + 1
        and is_norm(b.modules[m.path])
        and m.output in upstream
    ]
    mmap.final_norm = norms[-1] if norms else None
    mmap.found["logits"] = "traced"
