"""Top-k sparsified SGD with error feedback, aggregated by TopKAllReduce (gTop-k paper's baseline).

Each rank sends its own k largest accumulated entries; one allgather moves all P*k pairs and every rank
sums them. Cost: alpha*log2(P) + 2k(P-1)*beta per bucket, growing with P (gTop-k's motivation).
"""
from bagua_lite import comm, kernels
from bagua_lite.algorithm import register

from ._sparse import ErrorFeedbackSparsifier


@register("topk")
class TopK(ErrorFeedbackSparsifier):
    def aggregate(self, values, indices, acc, flat):
        kernels.ef_remove_(acc, indices)                      # residual = acc minus what we send
        # dense sum of every rank's selection, written into the bucket (rank order: identical replicas)
        comm.sparse_allreduce(values, indices, flat.numel(), group=self.process_group, out=flat)
        flat.div_(self.world_size)
        return indices
