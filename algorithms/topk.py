"""Top-k sparsified SGD with error feedback, aggregated by TopKAllReduce (gTop-k paper's baseline).

Each rank sends its own k largest accumulated entries; one allgather moves all P*k pairs (k is the same
on every rank, so no size exchange precedes it) and every rank sums them. Cost: alpha*log2(P) +
2k(P-1)*beta per bucket, growing with P (gTop-k's motivation).
"""
from bagua_lite import comm, kernels
from bagua_lite.algorithm import register

from .parts.sparse import ErrorFeedbackSparsifier


@register("topk")
class TopK(ErrorFeedbackSparsifier):
    @classmethod
    def sparse_traffic(cls, o, P, k, e, rank, machine=None, n=None):
        """One allgather of [k, dtype as 2 int64][k values][k int32] from each of the P - 1 others; then
        the scatter of the P k pairs."""
        b = (P - 1) * (16 + k * (e + 4))
        return (b, P - 1, b), (P * k * machine.add_s_per_elem if machine is not None else 0.0)

    def init(self, model):
        super().init(model)
        self._verified = {}  # bucket index -> (group, k) of its last exchange, whose headers were checked

    def aggregate(self, values, indices, acc, flat, bucket):
        kernels.ef_remove_(acc, indices)                      # residual = acc minus what we send
        # every rank's selection, pre-divided by P (k divisions instead of n), summed into the bucket in
        # rank order on every rank (replicas stay identical); the bucket is cleared only where the previous
        # step wrote, not memset whole
        # k is the same on every rank (the density schedule's, checked by the step count when it changes):
        # no size exchange, one message round per bucket
        # Every block carries its k and dtype; the receivers check them (on a GPU a read back to the host) at
        # the bucket's first exchange on this group and whenever its k changes, not at every repeat of one
        # verified: bucket order, sizes and dtypes do not change between steps
        k, pg = values.numel(), self.process_group
        last = self._verified.get(bucket.index)
        verify = last is None or last[0] is not pg or last[1] != k
        g_values, g_indices = comm.sparse_allgather(values.div_(self.world_size), indices, group=pg, k=k,
                                                    out=self.result_out(bucket, self.world_size * k), verify=verify)
        self._verified[bucket.index] = (pg, k)
        self.clear_result(flat, bucket.index)
        kernels.scatter_add_(flat, g_values, g_indices)
        return g_indices
