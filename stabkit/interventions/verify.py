"""Check that applied interventions are in effect: one traced forward on an example input.

Runs once in `stabkit.interventions.apply` (and so at `attach(..., interventions=...)`) after the
surgery, when an example input exists (given, made by discovery, or the one discovery last traced).
The forward runs under discovery's trace (`stabkit.discovery.trace.run_trace`: RNG streams and
buffers restored, no parameter gradient), so training is unchanged. What is checked:

- every intervention: the forward runs (a norm hooked onto a tensor of the wrong width fails here,
  not in training), no kernel call was left unchanged (`stabkit.interventions.kernel_change`: a change
  that would reach the forward only, or one the kernel cannot take), every module holding a
  parameter the intervention added runs, and the first kernel call it changed in each module trains
  with the gradients of its changed forward (`check_backward`: one backward against a central
  difference, outside the trace);
- then each intervention's own check, its plug-in's `Intervention.verify` (looked up by name in
  `stabkit.plugins.INTERVENTIONS`), which the built-ins take from here:
  ``qk_norm`` (`check_qk_norm`): at every attention call the trace sees, each head's query and key
  vectors have one norm across batch rows and positions (the gain's; whatever route normalised them
  — a rotation such as RoPE after the norm keeps it); ``attn_softcap`` (`check_capped`): every
  attention module it caps had a call capped (its handlers count them).

A check that fails removes nothing itself: `apply` removes the interventions and raises the
InterventionError this module raises, naming the intervention, the module and what was seen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..discovery.examples import as_example
from ..discovery.trace import Trace, run_trace
from ..plugins import INTERVENTIONS
from .handle import Handle, InterventionError

RTOL = 2e-2
"""Largest relative spread of one head's q (or k) norms that counts as normalised (a norm's eps moves
small vectors by up to ~1 %; an unnormalised head spreads by tens of %)."""


def _spread(x: torch.Tensor) -> torch.Tensor:
    """(H,) relative spread (max − min) / max of each head's vector norms, over rows and positions;
    all-zero vectors (a zero-initialised token) are left out."""
    norms = x.detach().double().norm(dim=-1).transpose(0, 1).reshape(x.shape[1], -1)  # (H, B·L)
    top = norms.amax(dim=1, keepdim=True)
    kept = norms > 1e-6 * top.clamp_min(1e-30)
    low = torch.where(kept, norms, torch.inf).amin(dim=1)
    return (top.squeeze(1) - low) / top.squeeze(1).clamp_min(1e-30)


def check_qk_norm(trace: Trace) -> None:
    """``qk_norm``: q and k reach every traced attention call normalised per head."""
    for call in trace.calls:
        if call.q is None or call.k is None or call.q.dim() != 4:
            continue
        for which, x in (("queries", call.q), ("keys", call.k)):
            spread = _spread(x)
            if bool((spread > RTOL).any()):  # sync point (apply time)
                worst = float(spread.max())
                raise InterventionError(
                    "qk_norm",
                    call.scope or "<root>",
                    f"not in effect: the {which} reaching its {call.kind} attention call are not "
                    f"normalised per head (norms differ by {worst:.1%} within a head)",
                )


def _check_ran(trace: Trace, model: nn.Module, name: str, handle: Handle) -> None:
    new = {id(p) for p in handle.new_parameters()}
    if not new:
        return
    ran = {m.path for m in trace.modules}
    for path, module in model.named_modules():
        owns = any(id(p) in new for p in module.parameters(recurse=False))
        if owns and path not in ran:
            raise InterventionError(name, path, "not in effect: the module it added never ran in a forward")


def verify(model: nn.Module, handles: dict[str, Handle], example: Any) -> None:
    """Run one traced forward of `model` on `example` and check each intervention in `handles`
    (name -> its handle). Raises InterventionError for the first one not in effect."""
    args, kwargs = as_example(example)
    for handle in handles.values():
        handle.counts.clear()
        handle.refused.clear()
        handle.changed_calls.clear()
        handle.verifying = True
    try:
        trace = run_trace(model, args, kwargs)
    except InterventionError:
        raise
    except Exception as exc:  # the surgery broke the forward (or a call it left unchanged failed)
        for name, handle in handles.items():
            for path, why in handle.refused.items():
                raise InterventionError(
                    name, path, f"not in effect: an attention call was left unchanged: {why}"
                ) from exc
        names = ", ".join(handles)
        raise InterventionError(
            names, type(model).__name__, f"the model's forward fails with it: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for handle in handles.values():
            handle.verifying = False
    for name, handle in handles.items():
        for path, why in handle.refused.items():
            raise InterventionError(name, path, f"not in effect: an attention call was left unchanged: {why}")
        _check_ran(trace, model, name, handle)
        check_backward(name, handle)
        if name in INTERVENTIONS:
            INTERVENTIONS.load(name)().verify(trace, model, handle)


def check_backward(name: str, handle: Handle) -> None:
    """Every kernel call `name` changed trains with the gradients of its changed forward: one backward
    against a central difference (`stabkit.interventions.backward_check`)."""
    calls, handle.changed_calls = handle.changed_calls, {}
    for path, check in calls.items():
        result = check()
        if result is not None and result[0] > result[1]:
            raise InterventionError(
                name,
                path,
                "not in effect as it would train: the changed attention call's backward disagrees with its "
                f"forward (directional derivative off by {result[0]:.1%} against a central difference); the "
                "kernel's backward does not see the change — change it in the model, or fix the kernel's "
                "autograd formula",
            )


def check_capped(name: str, handle: Handle) -> None:
    """``attn_softcap``: every module it caps (``handle.capped_paths``) had a call capped."""
    for path in getattr(handle, "capped_paths", []):
        if handle.counts.get(path, 0) == 0:
            raise InterventionError(
                name, path, "not in effect: the module ran without a call stabkit could cap"
            )
