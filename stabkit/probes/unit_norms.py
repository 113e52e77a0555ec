"""Per-unit L2 norms from per-parameter norms, in a constant number of ops.

The gradient probe combines per-parameter norms (gradients, parameters, updates) into one norm per
unit (a block, or the module owning a parameter) on sampled steps. Done unit by unit that is a
stack and a norm per unit and list; here it is one ``index_add_`` over an index of every
parameter's unit, made on the parameters' device when the probe sets up (at attach, or when the
watched parameters change — a host-to-device copy then, never inside a training step's hooks).
"""

from __future__ import annotations

import torch


class UnitNorms:
    """Squared per-unit sums of per-parameter norms: ``√Σ nᵢ²`` over the parameters of each unit."""

    def __init__(self, unit_index: list[int], n_units: int, device: torch.device | None) -> None:
        self.unit_index = unit_index
        """Unit of each parameter (position in the probe's parameter list)."""
        self.n_units = n_units
        self.device = device
        """Where the parameters' local pieces live (None: no parameters, or on several devices)."""
        self._index = None if device is None else torch.tensor(unit_index, device=device)
        self._zero = None if device is None else torch.zeros((), device=device)

    @classmethod
    def of(cls, unit_index: list[int], n_units: int, devices: list[torch.device]) -> UnitNorms:
        """For parameters on `devices` (one per parameter): vectorised when they share one device."""
        one = devices[0] if devices and all(d == devices[0] for d in devices) else None
        return cls(unit_index, n_units, one)

    def squares(self, idx: list[int], norms: list[torch.Tensor]) -> torch.Tensor | None:
        """(U,) Σ nᵢ² per unit of the norms `norms` of parameters `idx` (absent parameters count 0),
        or None when the norms cannot be combined at once (parameters on several devices)."""
        if self._index is None or self._zero is None:
            return None
        if any(n.device != self.device for n in norms):
            return None
        if len(idx) == len(self.unit_index):
            values = norms
        else:
            values = [self._zero] * len(self.unit_index)
            for i, n in zip(idx, norms, strict=True):
                values[i] = n
        sq = torch.stack(values).float().square()  # (P,): the norms are 0-d
        return torch.zeros(self.n_units, device=self.device).index_add_(0, self._index, sq)

    def units(self, idx: list[int]) -> list[int]:
        """The units that parameters `idx` belong to, in unit order."""
        return sorted({self.unit_index[i] for i in idx})
