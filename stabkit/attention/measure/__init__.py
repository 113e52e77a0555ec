"""Attention measurement, in one home: from q and k (or the logits) of one attention call to the
statistics of its heads — max logit, entropy, first-key and sink mass — on a sample or exactly, in
blocks within a byte budget, eagerly or as one opaque op in a compiled graph.

Imported downward by the attention probe (`stabkit.probes.attention`, which decides when to measure
and records the values) and by QK-Clip (`stabkit.interventions.qkclip*`, which needs the per-head
maxima to rescale q and k). Runs on sampled steps inside the attention module's forward, under
``no_grad``, never on the host.

- `measure` — one call's `HeadStats` (`measure.measure`); `fast` its one-block path;
- `blocks`, `masks`, `sample` — the block plan, the masks per block, the row/query sample;
- `stats` — `HeadStats` and the running sums, the soft-cap inversion (`uncap`);
- `op` — the compiled path: the same measurement inside one opaque custom op;
- `eager` — eager softmax attention read back to its unshifted logits;
- `sites` — what a call site's module says: its own soft cap, whether a softmax is attention-shaped.
"""
