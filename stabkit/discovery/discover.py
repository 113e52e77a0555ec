"""Discovery by behaviour with names as the fallback: trace one forward, build the map from it, and
fill in from module names only what the trace cannot tell.

Runs from `stabkit.inspect_model` (and so at `attach`, `audit` and `interventions.apply`); what it
traced is kept on the model (`known.Discovery`) so one trace serves them all while the model is unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from . import sharded
from .by_names import by_names
from .examples import as_example, synthesize_example
from .families import family_of
from .known import Discovery
from .modelmap import OPAQUE, DiscoveryError, ModelMap
from .trace import run_trace
from .trace_logits import logits_from_trace
from .trace_map import map_from_trace


def _no_trace_possible(model: nn.Module) -> bool:
    """True when no forward should be traced: a model on the meta device (no values to follow; HF mask
    code cannot run there), or sharded parameters (DTensors) that cannot be gathered to trace the model
    they shard (`sharded.unsharded`): no process group up, or too large."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return True
    if not sharded.is_sharded(model):
        return False
    from ..distributed.context import process_group_active

    return not process_group_active() or sharded.full_bytes(model) > sharded.FULL_LIMIT


def traced_or_named(
    model: nn.Module, example: Any, by_names: Callable[[nn.Module, dict[str, Any]], ModelMap]
) -> ModelMap:
    """Trace one forward (on `example` or a synthesised input) and map the model from it; fall back to
    names (with a note saying why) when no forward can be traced."""
    cached = Discovery.of(model).traced(model) if example is None else None
    if cached is not None:
        return cached
    reason = ""
    ex = as_example(example) if example is not None else None
    if ex is None and not _no_trace_possible(model):
        ex = Discovery.of(model).example or synthesize_example(model)
        if ex is None:
            reason = "no example input (pass example= to trace one forward)"
    elif _no_trace_possible(model):
        reason = "meta device, or sharded parameters without a process group or too large to gather"
    if ex is not None:
        try:
            return traced_map(model, ex)
        except DiscoveryError as exc:
            try:
                mmap = by_names(model, {})
            except DiscoveryError:
                raise exc from None
            mmap.notes.append(f"the traced forward saw no attention call; roles from module names ({exc})")
            mmap.found = {"blocks": "named", "attention": "named", "placement": "named"}
            return mmap
        except Exception as exc:  # the model needs inputs stabkit cannot guess
            if example is not None:
                raise DiscoveryError(
                    f"tracing one forward of {type(model).__name__} on the given example failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            reason = f"the synthesised example did not run ({type(exc).__name__}: {str(exc)[:120]})"
            wrapped = _wrapped(model) if _no_forward(model) else None
            if wrapped is not None:
                return wrapped
    try:
        mmap = by_names(model, {})
    except DiscoveryError as exc:
        raise DiscoveryError(f"{exc}. Tracing was not possible: {reason}") from None
    mmap.notes.append(f"roles from module names: {reason}")
    mmap.found = {"blocks": "named", "attention": "named", "placement": "named"}
    return mmap


def traced_map(model: nn.Module, example: Any, prefix: str = "") -> ModelMap:
    """Trace ``model.get_submodule(prefix)(*args, **kwargs)`` once and map `model` from it (paths from
    the root); kept (`Discovery.of(model)`) for the `inspect` calls that follow while the model is unchanged."""
    module = model.get_submodule(prefix) if prefix else model
    args, kwargs = as_example(example)
    with sharded.unsharded(model):
        trace = run_trace(module, args, kwargs)
    mmap = map_from_trace(module, trace).under(prefix)
    if mmap.found.get("attention") == "none":
        mmap = _names_for_opaque(model, mmap)
    _complete(model, mmap)
    _warn_unmonitored(mmap)
    Discovery.of(model).remember(model, mmap, None if prefix else (args, kwargs))
    return mmap


def _names_for_opaque(model: nn.Module, traced: ModelMap) -> ModelMap:
    """The traced forward made no attention call stabkit can read: module names may still tell the
    blocks, attention modules, MLPs and norm placement (their impl is opaque: the trace saw no call);
    the logits stay the traced ones. Without a match by names, the traced repeated units stand."""
    try:
        named = by_names(model, {})
    except DiscoveryError:
        return traced
    for a in named.attentions:
        a.impl, a.qk_note = OPAQUE, "its forward made no attention call stabkit can read"
    if traced.logits is not None:
        named.logits, named.output_head, named.vocab_size = (
            traced.logits,
            traced.output_head,
            traced.vocab_size,
        )
        named.final_norm = traced.final_norm
    named.gaps, named.notes = (
        traced.gaps,
        [*traced.notes, *named.notes, "blocks and attention modules from names"],
    )
    named.found = {"blocks": "named", "attention": "named", "placement": "named", "logits": "traced"}
    return named


def _no_forward(model: nn.Module) -> bool:
    """True for a module without a forward of its own (a wrapper: a LightningModule's training_step
    calls `self.model`)."""
    return getattr(type(model), "forward", None) is getattr(nn.Module, "forward", None)


def _wrapped(model: nn.Module) -> ModelMap | None:
    """A wrapper without a forward of its own (a LightningModule whose training_step calls
    `self.model`): trace the outermost submodule that runs on a made-up input."""
    for prefix, sub in model.named_modules():
        if not prefix or prefix.count(".") > 1 or sub is model:
            continue
        ex = synthesize_example(sub)
        if ex is None:
            continue
        try:
            return traced_map(model, ex, prefix)
        except Exception:  # not this one
            continue
    return None


def _complete(model: nn.Module, mmap: ModelMap) -> None:
    """Label the family and fill what only names tell (embeddings, d_model) into a traced map."""
    first = model.get_submodule(mmap.blocks[0].path) if mmap.blocks else model
    family = family_of(first)
    if mmap.found.get("blocks") != "named":  # a map by names keeps the family its names gave
        mmap.family = family if family != "fallback" else "traced"
    mmap.embeddings = [
        n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and mmap.block_of(n) is None
    ]
    if mmap.embeddings:
        mmap.d_model = getattr(model.get_submodule(mmap.embeddings[0]), "embedding_dim", None)
        mmap.found["embeddings"] = "named"
    if mmap.d_model is None and mmap.blocks:
        a = mmap.first_attention
        if a is not None and a.n_heads and a.head_dim:
            mmap.d_model = a.n_heads * a.head_dim
    if mmap.output_head is None and mmap.logits is None:
        mmap.notes.append(
            "the model's output is not logits computed after the last block (no logits/ statistics)"
        )


def _warn_unmonitored(mmap: ModelMap) -> None:
    """Note call sites whose q/k rows are unknown (interventions that need them refuse)."""
    missing = [f"{a.path or '<root>'}: {a.qk_note}" for a in mmap.attentions if a.qk_note and not a.qk_norm]
    if missing:
        mmap.notes.extend(f"q/k rows unknown at {m}" for m in missing)


def report_gaps(model: nn.Module, mmap: ModelMap, strict: bool = False) -> None:
    """Say what discovery could not find — once per model while it is unchanged — as one warning;
    with `strict`, raise DiscoveryError instead. Runs at attach (and `inspect_model`), never per step."""
    if not mmap.gaps:
        return
    text = (
        "stabkit: "
        + " ".join(mmap.gaps)
        + ". Everything else is monitored (MonitorConfig(strict=True) raises instead)"
    )
    if strict:
        raise DiscoveryError(
            text.replace(
                "Everything else is monitored (MonitorConfig(strict=True) raises instead)",
                "strict mode: stopping",
            )
        )
    if not Discovery.of(model).first_time_said(model):
        return
    warnings.warn(text, RuntimeWarning, stacklevel=4)


def logits_only(model: nn.Module, example: Any = None) -> ModelMap | None:
    """A map holding only the final logits, from a traced forward (None when none can run)."""
    ex = as_example(example) if example is not None else synthesize_example(model)
    if ex is None or _no_trace_possible(model):
        return None
    try:
        with sharded.unsharded(model):
            trace = run_trace(model, *ex)
        return logits_from_trace(model, trace)
    except Exception:  # the model needs inputs stabkit cannot guess
        return None


WAIT = "wait"
"""What `trace_first` returns when discovery must wait for the model's first forward."""


def trace_first(model: nn.Module) -> str:
    """At attach, with neither a map nor an example given: trace one forward now, on an input stabkit
    makes, and keep the map for the calls that follow (`Discovery.of(model)`). Returns `WAIT` when
    discovery must wait for the model's first forward instead — no input can be made for it, or the
    one stabkit makes fits neither its forward nor a wrapped submodule's (an encoder-decoder taking two
    sequences) — and "ready" otherwise (sharded models use names; a trace that ran but found no
    attention lets `inspect_model` say what it saw)."""
    if _no_trace_possible(model) or Discovery.of(model).traced(model) is not None:
        return "ready"
    ex = synthesize_example(model)
    if ex is None:
        return WAIT
    try:
        traced_map(model, ex)
    except DiscoveryError:
        return "ready"
    except NotImplementedError:  # no forward of its own (a wrapper), or a forward that cannot run here
        return WAIT if not _no_forward(model) or _wrapped(model) is None else "ready"
    except Exception:  # the made-up input does not fit this model: wait for its first forward
        return WAIT
    return "ready"
