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
from bagua_lite.algorithm import register

from ._sparse import ErrorFeedbackSparsifier


@register("gtopk")
class GTopK(ErrorFeedbackSparsifier):
    def __init__(self, density: float = 0.001, warmup_densities: list = (0.25, 0.0625, 0.016, 0.004),
                 warmup_steps_per_stage: int = 0, momentum_correction=None, layerwise: bool = False,
                 exact: bool = False):
        super().__init__(density, warmup_densities, warmup_steps_per_stage, momentum_correction, layerwise)
        self.exact = exact

    def aggregate(self, values, indices, acc, flat, bucket):
        k = values.numel()
        g_values, g_indices = comm.gtopk_allreduce(values, indices, k, group=self.process_group, exact=self.exact)
        sent = g_indices[torch.isin(g_indices, indices)]  # exact or not: only what this rank sent
        kernels.ef_remove_(acc, sent)
        self.clear_result(flat, bucket.index)           # k entries, not the whole bucket
        kernels.scatter_add_(flat, g_values.div_(self.world_size), g_indices)  # average: divide k values, not n
        self._written[bucket.index] = g_indices
