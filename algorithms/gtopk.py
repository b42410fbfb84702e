"""gTop-k S-SGD (Shi et al., ICDCS'19): global Top-k sparsification with error feedback.

Algorithm 1 of the paper, per bucket (G: the bucket's flat gradient, eps: its residual):
    acc      <- G + eps                            (ErrorFeedbackSparsifier, with optional DGC momentum)
    V, I     <- topk(acc, k)                       (local top-k, radix select in C++)
    gV, gI   <- gTopKAllReduce(V, I, k)            (recursive doubling: log2 P rounds of k pairs)
    eps      <- acc with entries in I ∩ gI zeroed  (locally selected and globally kept were sent;
                                                    also with exact=True: the exact sum at gI adds each
                                                    rank's *selected* value there, 0 where the rank did
                                                    not select it, so entries of gI outside I were not
                                                    sent and stay in the residual)
    G        <- scatter(gV, gI) / P
"""
import torch

from bagua_lite import comm, kernels
from bagua_lite import cost_model as cm
from bagua_lite.algorithm import register

from .parts.sparse import ErrorFeedbackSparsifier


@register("gtopk")
class GTopK(ErrorFeedbackSparsifier):
    def __init__(self, density: float = 0.001, warmup_densities: list = (0.25, 0.0625, 0.016, 0.004),
                 warmup_steps_per_stage: int = 0, momentum_correction=None, layerwise: bool = False,
                 exact: bool = False):
        super().__init__(density, warmup_densities, warmup_steps_per_stage, momentum_correction, layerwise)
        self.exact = exact

    @classmethod
    def sparse_traffic(cls, o, P, k, e, rank, machine=None):
        """Recursive doubling: log2 P' swaps of k pairs (P' the largest power of two <= P; the other ranks
        fold in first and receive last: 2 more messages on the critical path); each received message is
        merged (2k pairs), then the scatter of k. ``exact``: plus a ring allreduce of k values."""
        msg, core = k * (e + 4), cm.pow2_core(P)
        L, r = core.bit_length() - 1, 0 if rank is None else rank
        sent = (L + (1 if r + core < P else 0)) if r < core else 1
        b, lat = sent * msg, L + (2 if P > core else 0)
        crit = lat * msg
        if o["exact"]:
            b, lat, crit = b + cm.ring_bytes(k * e, P), lat + 2 * (P - 1), crit + cm.ring_bytes(k * e, P)
        local = 0.0
        if machine is not None:
            merge = machine.merge_s_per_elem or 4 * machine.topk_s_per_elem
            local = (L + (1 if P > core else 0)) * 2 * k * merge + k * machine.add_s_per_elem
        return (b, lat, crit), local

    def aggregate(self, values, indices, acc, flat, bucket):
        k = values.numel()
        g_values, g_indices = comm.gtopk_allreduce(values, indices, k, group=self.process_group, exact=self.exact)
        # Error feedback forgets what this rank sent and the global set kept (exact or not), by a mask over
        # this rank's k entries: a boolean index would read its count back from the device.
        mine = indices.long()
        acc.index_copy_(0, mine, acc.index_select(0, mine).masked_fill_(torch.isin(indices, g_indices), 0))
        self.clear_result(flat, bucket.index)           # k entries, not the whole bucket
        kernels.scatter_add_(flat, g_values.div_(self.world_size), g_indices)  # average: divide k values, not n
        return g_indices
