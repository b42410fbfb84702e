"""Top-k sparsified SGD with error feedback, aggregated by TopKAllReduce (gTop-k paper's baseline).

Each rank sends its own k largest accumulated entries; one allgather moves all P*k pairs and every rank
sums them. Cost: alpha*log2(P) + 2k(P-1)*beta per bucket, growing with P (gTop-k's motivation).
"""
from bagua_lite import comm, kernels
from bagua_lite.algorithm import register

from ._sparse import ErrorFeedbackSparsifier


@register("topk")
class TopK(ErrorFeedbackSparsifier):
    def aggregate(self, values, indices, acc, flat, bucket):
        kernels.ef_remove_(acc, indices)                      # residual = acc minus what we send
        # dense sum of every rank's selection / P (pre-divided: k divisions instead of n), written into the
        # bucket; summed in rank order on every rank, so replicas stay identical
        comm.sparse_allreduce(values.div_(self.world_size), indices, flat.numel(), group=self.process_group,
                              out=flat)
        return indices
