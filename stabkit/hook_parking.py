"""Hook parking: between the steps a module's hooks act on, the module has no hooks at all.

Most of stabkit's forward hooks act only on sampled steps (activations, log Z, outliers, the attention
scope, the training-forward bookkeeping they read); on other steps each returns after a flag check.
The flag check is cheap; what is not is that a module with any forward hook leaves torch's fast path:
``Module._call_impl`` then builds the hook lists and calls each hook (~10 µs a module on a CPU, ~0.3 ms
a step on a 4-layer model — a point of the step time where steps are short). So a module whose every
forward (pre-)hook is one of stabkit's cadenced ones (`Registrar.forward` with ``cadence``) has them
taken off between the steps any of them acts on, and put back, in the same order, before such a step.
A module that also has hooks of anyone else's (the user's, an intervention's, FSDP's) keeps them all:
nothing is reordered around a hook stabkit does not own.

When it runs: `follow(step)` at each change of the step count (`Monitor._refresh_phase`: attach,
`Monitor.step`, `load_state_dict`), outside any forward; `restore_all` before hooks are removed
(`HookSet.remove`). A step whose hooks are all where they were costs a tuple comparison.

Eager only. Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``), so code compiled
while hooks were off would run without them for good. Parking therefore stops for the rest of the run
at the first ``torch.compile`` frame compiled in the process after attach (Dynamo's frame counter,
read once a step), with every hook put back; when that frame was compiled while hooks were off, the
compiled code is reset once (`stabkit.compiled_code.forget_compiled_code`) so it recompiles with them,
and a warning says so. Training is unchanged either way: a parked hook would have done nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .compiled_code import dynamo_frames, forget_compiled_code

COMPILED_ONLY = 0
"""A `cadence` for hooks that act only while torch.compile traces them (eager, they return at once):
parked on every step while parking lasts (it stops at the first compile)."""

PARK = True
"""False: never park (for comparing the two; `HookParking` reads it at each `follow`)."""


def acts_on(cadence: int, step: int) -> bool:
    """Whether a hook of `cadence` acts on eager step `step`."""
    return cadence > 0 and step % cadence == 0


class ParkableHandle(RemovableHandle):
    """The handle of a cadenced hook: removing it also drops it from its module's parked hooks."""

    def __init__(self, handle: RemovableHandle, on_remove: Callable[[int], None]) -> None:
        self.__setstate__(handle.__getstate__())
        self._on_remove = on_remove

    def remove(self) -> None:
        self._on_remove(self.id)
        super().remove()


class _Module:
    """One module with cadenced hooks: their cadences, and its hooks while parked."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.cadences: dict[int, int] = {}
        """Handle id -> cadence, for this module's cadenced forward (pre-)hooks."""
        self.parked: tuple[OrderedDict[int, Any], OrderedDict[int, Any]] | None = None
        """(forward pre-hooks, forward hooks) taken off the module, in their order; None: in place."""

    def live(self, step: int) -> bool:
        return any(acts_on(c, step) for c in self.cadences.values())

    def park(self) -> None:
        """Take the module's forward (pre-)hooks off, when every one of them is a cadenced one of ours."""
        pre, post = self.module._forward_pre_hooks, self.module._forward_hooks
        if not (pre or post) or any(k not in self.cadences for d in (pre, post) for k in d):
            return
        self.parked = (OrderedDict(pre), OrderedDict(post))
        pre.clear()
        post.clear()

    def restore(self) -> None:
        """Put the parked hooks back in their order, before any registered meanwhile."""
        if self.parked is None:
            return
        for saved, hooks in zip(self.parked, (self.module._forward_pre_hooks, self.module._forward_hooks)):
            added = list(hooks.items())
            hooks.clear()
            hooks.update(saved)
            hooks.update(added)
        self.parked = None

    def forget(self, handle_id: int) -> None:
        self.cadences.pop(handle_id, None)
        if self.parked is not None:
            for saved in self.parked:
                saved.pop(handle_id, None)


class HookParking:
    """The Monitor's parked hooks (one per `HookSet`; see the module docstring)."""

    def __init__(self) -> None:
        self._modules: dict[int, _Module] = {}
        self._cadences: tuple[int, ...] = ()
        self._key: tuple[bool, ...] | None = None
        """Which cadences act on the step the hooks were last placed for (None: place them anew)."""
        self._frames = dynamo_frames()
        self.stopped = False
        """True once torch.compile compiled a frame after attach: every hook stays in place."""

    def track(self, module: nn.Module, handle: RemovableHandle, cadence: int) -> RemovableHandle:
        """At registration: `handle`'s hook on `module` acts every `cadence` steps."""
        entry = self._modules.setdefault(id(module), _Module(module))
        entry.cadences[handle.id] = cadence
        self._cadences = tuple(sorted({*self._cadences, cadence}))
        self._key = None
        return ParkableHandle(handle, self._forget)

    def _forget(self, handle_id: int) -> None:
        for entry in self._modules.values():
            entry.forget(handle_id)

    @property
    def parked(self) -> int:
        """How many modules have their hooks off now."""
        return sum(entry.parked is not None for entry in self._modules.values())

    def follow(self, step: int) -> None:
        """The step in progress is now `step` (eager, between steps): hooks on for the modules with a
        hook acting on it, off for the others (see the module docstring)."""
        if self.stopped or not self._modules:
            return
        if not PARK:
            self.restore_all()
            return
        if dynamo_frames() != self._frames:
            self._stop()
            return
        key = tuple([c > 0 and step % c == 0 for c in self._cadences])  # `acts_on`, in one call
        if key == self._key:
            return
        self._key = key
        try:
            for entry in self._modules.values():
                if entry.live(step):
                    entry.restore()
                elif entry.parked is None:
                    entry.park()
        except Exception as exc:  # a model whose hook dicts stabkit does not understand: leave them be
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        """Parking failed: every hook back where it can be, parking off for the run, said once.
        Training goes on; only the saving is lost."""
        self.stopped = True
        for entry in self._modules.values():
            with contextlib.suppress(Exception):  # a module that cannot take its hooks back keeps going
                entry.restore()
        warnings.warn(
            f"stabkit: taking its sampled-only hooks off the model between sampled steps failed "
            f"({type(exc).__name__}: {exc}); they stay on from now on (statistics unchanged, the "
            "saving of ~0.3 ms a step is lost)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _stop(self) -> None:
        """torch.compile compiled a frame: hooks back for good, and compiled code reset if they were off."""
        self.stopped = True
        compiled_while_parked = self.parked > 0
        self.restore_all()
        if compiled_while_parked:
            forget_compiled_code(warn=False)
            warnings.warn(
                "stabkit: torch.compile compiled code while stabkit's hooks for sampled steps were off "
                "(between sampled steps, where they do nothing); Dynamo does not see hooks come back, so "
                "compiled code was reset and recompiles once with them, and they now stay on. Compile "
                "before attach, or make the first compiled call on step 0, to avoid the recompile",
                RuntimeWarning,
                stacklevel=4,
            )

    def restore_all(self) -> None:
        """Every parked hook back in place (before hooks are removed; when parking stops)."""
        for entry in self._modules.values():
            entry.restore()
        self._key = None
