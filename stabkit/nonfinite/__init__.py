"""The kinds decided on the device: NaN/Inf ('nonfinite') and the fp16 GradScaler's overflow ('amp').

Their plug-in faces are ordinary detectors (`kind.NonfiniteDetector` with `options.NonfiniteOptions`,
`amp.AmpDetector`: options, advice rows, signatures; importing them loads no torch); what they
decide from tensors is their device part, declared through the detectors' extension point
(`stabkit.detectors.device`) and built at attach by the orchestration (`stabkit.decisions`):

- `watch.NonfiniteWatch`: the per-step checks of the loss, the global gradient norm, the model
  output, parameters and optimizer state, and the localization of the producer;
- `guard.StepGuard`: root-model hooks that keep each forward of the step (inputs by reference, RNG,
  autocast) for a replay and flag a non-finite output; `rerun_forward` / `rng_state` also serve the
  actions (rescue);
- `tracer.FiniteTracer`: per-module finite checks naming the first module that produced NaN/Inf;
- `localize`: the replay, and which parameter an update broke;
- `scaler.ScalerCheck` ('amp', with a GradScaler): whether a skipped step's weights are broken.

Nothing imports the device modules but their own detectors (when attach builds the device part)
and the rescue action (`guard.rerun_forward`); they import detectors, probes, stats and hooks, never
the monitor, the orchestration or the actions.
"""

from .amp import AmpDetector
from .kind import NonfiniteDetector
from .options import NonfiniteOptions

__all__ = ["AmpDetector", "NonfiniteDetector", "NonfiniteOptions"]
