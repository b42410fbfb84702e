"""Which entries a Top-k or gTop-k bucket sends (``parts.sparse``): the density schedule, the selection's
segments, and the top-k itself.

Density: each of ``warmup_densities`` for ``warmup_steps_per_stage`` steps, then ``density``. A bucket's
selection is one top-k over the whole bucket, or with ``layerwise`` (DGC's) one per non-empty tensor;
segment i of n_i entries selects k_i = round(density * n_i), at least 1.

The pass that writes the accumulator (``parts.sparse``'s on_gradient) also leaves the largest magnitude of
every 64 entries (block maxima), so the selection reads only the ~k blocks that can hold the top k, not
the whole bucket: exactly the same selection (mlp25m, P = 4, loopback: topk's selections took 9-10 ms of
CPU per rank and step, now 2.6-2.8). Not with layer-wise segments (they do not align with the blocks).
"""
import torch

from bagua_lite import kernels
from bagua_lite._options import int_at_least, within


def check(who, density, warmup_densities, warmup_steps_per_stage, layerwise):
    within(who, "density", density, "(0, 1]")
    for d in warmup_densities:
        within(who, "every warmup_densities entry", d, "(0, 1]")
    int_at_least(who, "warmup_steps_per_stage", warmup_steps_per_stage, 0)
    if not isinstance(layerwise, bool):
        raise TypeError(f"{who}: layerwise must be true or false, got {layerwise!r}")


class Selection:
    def __init__(self, density, warmup_densities, warmup_steps_per_stage, layerwise):
        self.density, self.warmup_densities = density, warmup_densities
        self.warmup_steps_per_stage, self.layerwise = warmup_steps_per_stage, layerwise
        self._segments = {}

    def density_at(self, step) -> float:
        """The schedule: each warm-up density for ``warmup_steps_per_stage`` steps, then the target."""
        if self.warmup_steps_per_stage > 0:
            stage = step // self.warmup_steps_per_stage
            if stage < len(self.warmup_densities):
                return self.warmup_densities[stage]
        return self.density

    def segments(self, bucket, density):
        """[(lo, hi, k_i)] of the bucket's selection at ``density``: one per non-empty tensor (layer-wise),
        or the whole bucket."""
        key = (bucket.index, density)
        if key not in self._segments:
            spans = ([(lo, lo + p.numel()) for lo, p in zip(bucket.offsets, bucket.params) if p.numel()]
                     if self.layerwise else [(0, bucket.numel)])
            self._segments[key] = [(lo, hi, kernels.topk_count(hi - lo, density)) for lo, hi in spans]
        return self._segments[key]

    def k_for(self, bucket, density) -> int:
        """Entries the bucket selects per rank and step: the sum of its segments' k_i."""
        return sum(k for _, _, k in self.segments(bucket, density))

    def allocate(self, buckets, use_block_max):
        """The selection's buffers: the values and indices of the largest k, and per bucket its block maxima
        (``block_max[b]``, raised by the pass that writes the accumulator; None: not kept). A bucket's are
        used only if every one of its tensors was written with them this round (``filled``), and are
        zeroed after each selection."""
        kmax = max(self.k_for(b, d) for b in buckets for d in [self.density] + self.warmup_densities)
        # topk_out reads the bounds only where k <= blocks / 4 (density <= 1/256); above that, keeping them
        # would cost the accumulating pass a max per element for nothing.
        use_block_max = use_block_max and self.density <= 1 / 256
        self.block_max = [torch.zeros((b.numel + 63) // 64, dtype=torch.int32)
                          if use_block_max and not self.layerwise and b.dtype == torch.float32
                          and b.flat.device.type == "cpu" else None for b in buckets]
        self.filled = [0] * len(buckets)
        device = buckets[0].flat.device  # the selection runs where the gradients are
        self._values = torch.empty(kmax, dtype=buckets[0].dtype, device=device)
        self._indices = torch.empty(kmax, dtype=torch.int32, device=device)

    def select(self, acc, bucket, density):
        """(values, indices into the bucket) of the top k of ``acc`` at ``density``, largest magnitudes."""
        bm = self.block_max[bucket.index]
        bounds = bm if bm is not None and self.filled[bucket.index] == len(bucket.params) else None
        k = 0
        for lo, hi, ki in self.segments(bucket, density):
            v, i = self._values[k:k + ki], self._indices[k:k + ki]
            kernels.topk_out(acc[lo:hi], ki, v, i, bounds)  # bounds: one segment, the whole bucket
            if lo:
                i.add_(lo)
            k += ki
        self.reset(bucket.index)
        return self._values[:k], self._indices[:k]

    def reset(self, b):
        """Forget bucket b's block maxima (after its selection, or a discarded round)."""
        if self.block_max[b] is not None:
            self.block_max[b].zero_()
        self.filled[b] = 0
