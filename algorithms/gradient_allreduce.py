"""Dense synchronous SGD: every gradient bucket is averaged over all ranks each step.

Options:
``compression``    ``none`` or any registered compressor (``fp16``, ``bf16``, ``minmax_uint8`` -- BAGUA's
                   ByteGrad: chunks quantized to uint8 over their [min, max], reduce-scattered and
                   allgathered compressed --, ``sign``, a user's). A compressor that asks for error
                   feedback (``sign``) gets a residual per bucket, kept here, not in the compressor.
``hierarchical``   reduce inside each node, allreduce among node leaders, broadcast inside each node.
``ranks_per_node`` node size for ``hierarchical`` (0: torchrun's ``LOCAL_WORLD_SIZE``); set it to test
                   the hierarchy on one machine.

With ``fault_tolerant=True`` the nodes are found, not counted: ranks that share a host (with
``ranks_per_node``: whose member id, their first generation's rank, falls in the same block of that many)
form a node, whatever their ranks are after a loss or a join; a node may be left with fewer ranks than
the others, and a joiner's node is its host's (with ``ranks_per_node``, its id's block).
"""
import os
import socket

import torch.distributed as dist

import torch

from bagua_lite import _C, comm, compressors
from bagua_lite import cost_model as cm
from bagua_lite._groups import new_group_like
from bagua_lite._options import int_at_least
from bagua_lite.algorithm import Algorithm, register


#: codecs that cast (no error feedback, no scale): a NaN or inf goes through them, and through their sums, as is
CASTS = ("bf16",)


@register("gradient_allreduce")
class GradientAllReduce(Algorithm):
    def __init__(self, compression: str = "none", hierarchical: bool = False, ranks_per_node: int = 0):
        super().__init__()
        self.compressor = compressors.get_compressor(compression, "gradient_allreduce")
        int_at_least(self.name, "ranks_per_node", ranks_per_node, 0)
        self.compression = compression
        self.hierarchical = hierarchical
        self.ranks_per_node = ranks_per_node

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """Per bucket, overlapped with backward. none: a ring allreduce of the bucket, and the divide; fp16:
        a ring allreduce of the half-precision bucket, cast there and back; any other compressor: the
        compressed allreduce (CA) with its local work and, where it keeps error feedback, its residual.
        hierarchical is predicted as the flat ring (a gap of the model)."""
        c, e = o["compression"], elem_bytes
        if c == "fp16" and not o["hierarchical"]:
            comm_, local = (lambda n, i: cm.ring(2 * n, P)), \
                (lambda n, i: n * (machine.fp16_s_per_elem + machine.add_s_per_elem))
        elif c == "none":
            comm_, local = (lambda n, i: cm.ring(n * e, P)), (lambda n, i: n * machine.add_s_per_elem if P > 1 else 0.0)
        else:
            feedback = cm.compressor_info(c)[2]
            comm_ = lambda n, i: cm.compressed_allreduce(c, P, n, rank)  # noqa: E731
            local = lambda n, i: cm.compressed_allreduce_s(c, P, n, machine, residual=feedback)  # noqa: E731
        return cm.Traffic("buckets", *cm.per_bucket(numels, P, comm_, local, machine))

    on_shards = True  # the bucket is an FSDP unit's reduce-scattered gradient (not hierarchical)

    def init(self, model):
        if model.sharded and self.hierarchical:
            raise ValueError(f"{self.name}: hierarchical=True is not supported on shards of an FSDP2 model (the "
                             f"replicate group already spans nodes only); use hierarchical=False")
        feedback = self.compressor is not None and self.compressor.error_feedback
        self.residuals = [torch.zeros_like(b.flat) if feedback else None for b in model.buckets]
        # checkpointed, and put back by the framework if a round is discarded (some rank's gradient non-finite)
        self.register_state("residuals", [r for r in self.residuals if r is not None], rollback=True)
        if self.hierarchical:
            self._node_groups(model)
        # decided once, not in every gradient hook
        self._prescaled = self._cast_allreduce() or (not self.hierarchical and self.compression == "none"
                                                     and not model.sharded)

    def _node_groups(self, model):
        """The groups inside each node and among the node leaders (collective)."""
        world = dist.get_process_group_ranks(model.process_group)
        if model.membership is None:
            n = self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", model.world_size))
            nodes = [world[i:i + n] for i in range(0, len(world), n)]
        else:  # the members' ranks change with every membership: a node is the ranks that share a host
            me = model.membership.member_id
            keys = [None] * len(world)
            dist.all_gather_object(keys, me // self.ranks_per_node if self.ranks_per_node else socket.gethostname(),
                                   group=model.control_group)
            order = list(dict.fromkeys(keys))
            nodes = [[r for r, k in zip(world, keys) if k == key] for key in order]
        self.nodes = nodes
        # Every rank creates every group, in the same order (new_group is collective).
        self.intra = None
        for node in nodes:
            g = new_group_like(model.process_group, node)
            if dist.get_rank() in node:
                self.intra, self.leader = g, node[0]
        leaders = [node[0] for node in nodes]
        g = new_group_like(model.process_group, leaders)
        self.inter = g if dist.get_rank() in leaders else None

    #: survivors carry on (fault_tolerant=True): error-feedback residuals are each rank's own and stay (put
    #: back to before the lost round); hierarchical: the nodes are found again (:meth:`regroup`)
    supports_membership_change = True

    def regroup(self):
        if self.hierarchical:
            self._node_groups(self.model)

    def _cast_allreduce(self):
        """fp16 without error feedback and not hierarchical: an allreduce of the half-precision bucket
        itself (summing in fp16 what was pre-scaled by 1/P, as torch's fp16_compress_hook), the same bytes
        as the compressed all-to-all + allgather, in one pipelined ring."""
        return self.compression == "fp16" and not self.hierarchical

    def on_gradient(self, bucket, position, grad):
        if self._prescaled:
            # Dense: scale by 1/P on the way into the bucket and allreduce the sum, so the average costs no
            # extra pass over the bucket (DDP does the same; the result is sum_i(g_i / P)).
            return self.fill(bucket, position, grad, 1.0 / self.world_size)
        return super().on_gradient(bucket, position, grad)

    def bucket_ops(self, bucket):
        if self.hierarchical:
            def hierarchical(flat):
                if bucket.nonfinite_seen(self.nonfinite_buckets):  # discarded anyway; compressors reject NaN
                    flat.zero_()
                self._hierarchical_allreduce(flat)
            return [hierarchical]
        if self.compression == "none":
            # pre-scaled in on_gradient; on shards summed and then divided, as FSDP2's own HSDP does (bit for bit)
            return [self.native.AllreduceOp(self.process_group, self.model.sharded)]
        if self._cast_allreduce():
            half = torch.empty(bucket.numel, dtype=torch.float16, device=bucket.device)
            pg, P = self.process_group, self.world_size

            def fp16_allreduce(flat):
                half.copy_(flat)
                dist.all_reduce(half, group=pg)
                flat.copy_(half)
                _C.count_sent(2 * (P - 1) * half.nbytes // P, 2 * (P - 1))  # what the ring sends
            return [fp16_allreduce]
        residual = self.residuals[bucket.index]

        def guard(flat):
            """Before the compressor: a non-finite gradient on this rank travels as zeros (quantizers
            reject NaN; the round is discarded on every rank anyway)."""
            if bucket.nonfinite_seen(self.nonfinite_buckets):
                flat.zero_()
        if self.compressor.native:
            op = self.native.CompressedAllreduceOp(self.process_group, self.compressor.name, True, residual)
            # a cast carries inf/NaN as they are (the result holds the verdict): no guard
            return [op] if self.compression in CASTS else [guard, op]

        def compressed_allreduce(flat):  # a user's Python compressor
            comm.compressed_allreduce(flat, self.compressor, group=self.process_group, residual=residual)
        return [guard, compressed_allreduce]

    step_dependent_wire = False  # the same buckets, sizes and collectives every step

    @property
    def device_verdict(self) -> str:
        """Dense sums (fp32, or cast to fp16 or bf16) give every rank the same result, inf/NaN wherever a rank's
        gradient held one: "result". The other codecs and hierarchical: "flags" (a bad rank's bucket is zeroed,
        as quantizers reject NaN; the residuals are register_state(rollback=True) state)."""
        if not self.hierarchical and (self.compression == "none" or self._cast_allreduce()
                                      or self.compression in CASTS):
            return "result"
        return "flags"

    def _hierarchical_allreduce(self, flat):
        dist.reduce(flat, dst=self.leader, group=self.intra)             # 1. sum inside the node
        if self.inter is not None:                                        # 2. leaders: sum across nodes
            comm.compressed_allreduce(flat, self.compression, group=self.inter, op="sum")  # "none": dense
        comm.broadcast(flat, 0, group=self.intra)                         # 3. leader -> node
        flat.div_(self.world_size)
