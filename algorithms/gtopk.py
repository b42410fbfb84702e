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

The indices travel as a bitmap of the bucket where that is smaller (density above 1/32). ``value_bits=4``
sends each value as a 4-bit level with one scale per 64 values: the values' part of a message falls from
4 bytes to about 0.56, and what a rank's levels left out of an entry it sent stays in its residual (the
collective hands back what was sent). With more than 2 ranks a merged set is quantized again before each
later round; that error is no rank's and is not fed back.

``final_union=True`` departs from the paper in its last round: the two partners keep the whole union of
their sets (at most 2k entries) instead of its k largest. A round's messages are its inputs, so that costs no
byte (when P is not a power of two, the hand-back to the extra ranks is laid out for 2k), and what would
have been cut goes to the weights instead of back to the residuals; at P = 2 the step applies both ranks'
selections (as topk does, in gtopk's wire). The update is then up to 2k-sparse.

On a GPU the selection (exactly k entries, ascending indices) goes to the collective as a canonical set, and
the plain message's rounds (no bitmap, no 4-bit values, not ``exact``, no final union) merge in fixed-size
tensor ops on the device: no host copy, bit for bit the host's merge (``comm.gtopk_allreduce(canonical=True)``).
"""
import os

from bagua_lite import comm, kernels
from bagua_lite import cost_model as cm
from bagua_lite.algorithm import register

from .parts.sparse import ErrorFeedbackSparsifier


@register("gtopk")
class GTopK(ErrorFeedbackSparsifier):
    def __init__(self, density: float = 0.001, warmup_densities: list = (0.25, 0.0625, 0.016, 0.004),
                 warmup_steps_per_stage: int = 0, momentum_correction=None, layerwise: bool = False,
                 exact: bool = False, value_bits=None, final_union: bool = False):
        super().__init__(density, warmup_densities, warmup_steps_per_stage, momentum_correction, layerwise)
        if value_bits not in (None, 4) or isinstance(value_bits, bool):
            raise ValueError(f"gtopk: value_bits must be None (values as the bucket's dtype) or 4, got {value_bits!r}")
        if exact and value_bits is not None:
            raise ValueError("gtopk: exact=True sums the ranks' exact values; it cannot be combined with value_bits=4")
        if not isinstance(final_union, bool):
            raise ValueError(f"gtopk: final_union must be true or false, got {final_union!r}")
        self.exact, self.value_bits, self.final_union = exact, value_bits, final_union

    @staticmethod
    def message_bytes(k, e, n, value_bits=None):
        """One message of k entries of a bucket of n: values (e bytes each, or 4-bit levels and a float32
        scale per 64), then the indices (k int32, or a bitmap of n bits where that is smaller)."""
        values = 4 * -(-k // 64) + (k + 1) // 2 if value_bits == 4 else k * e
        bitmap = n is not None and -(-n // 8) < 4 * k
        return values + (-(-n // 8) if bitmap else 4 * k)

    @classmethod
    def sparse_traffic(cls, o, P, k, e, rank, machine=None, n=None):
        """Recursive doubling: log2 P' swaps of k pairs (P' the largest power of two <= P; the other ranks
        fold in first and receive last: 2 more messages on the critical path); each received message is
        merged (2k pairs), then the scatter of k. ``exact``: plus a ring allreduce of k values."""
        msg, core = cls.message_bytes(k, e, n, o.get("value_bits")), cm.pow2_core(P)
        back = cls.message_bytes(2 * k, e, n, o.get("value_bits")) if o.get("final_union") else msg  # the hand-back
        L, r = core.bit_length() - 1, 0 if rank is None else rank
        b = (L * msg + (back if r + core < P else 0)) if r < core else msg
        lat = L + (2 if P > core else 0)
        crit = L * msg + ((msg + back) if P > core else 0)
        if o["exact"]:
            b, lat, crit = b + cm.ring_bytes(k * e, P), lat + 2 * (P - 1), crit + cm.ring_bytes(k * e, P)
        local = 0.0
        if machine is not None:
            merge = machine.merge_s_per_elem or 4 * machine.topk_s_per_elem
            local = (L + (1 if P > core else 0)) * 2 * k * merge + k * machine.add_s_per_elem
        return (b, lat, crit), local

    def init(self, model):
        super().init(model)
        # The selection's output is canonical with exactly k entries: on a GPU the rounds merge in tensor ops
        # there, with no host copy (BAGUA_LITE_TENSOR_ROUNDS=1: on any device, as the CPU tests run them)
        self._canonical = model.buckets[0].device.type == "cuda" or os.environ.get("BAGUA_LITE_TENSOR_ROUNDS") == "1"

    def aggregate(self, values, indices, acc, flat, bucket):
        k = values.numel()
        # value_bits=4 overwrites values with what of this rank's contribution the result kept (decoded levels).
        g_values, g_indices = comm.gtopk_allreduce(values, indices, k, group=self.process_group, exact=self.exact,
                                                   numel=flat.numel(), value_bits=self.value_bits,
                                                   final_union=self.final_union, canonical=self._canonical,
                                                   out=self.result_out(bucket, 2 * k if self.final_union else k))
        # Error feedback forgets what this rank sent and the global set kept (exact or not).
        if self.value_bits is None:
            kernels.ef_remove_(acc, indices, kept=g_indices)
        else:  # values: what of this rank's levels the result kept; what they left out stays (a - v == a + -v)
            kernels.scatter_add_(acc, values.neg_(), indices)
        self.clear_result(flat, bucket.index)           # k entries, not the whole bucket
        kernels.scatter_add_(flat, g_values.div_(self.world_size), g_indices)  # average: divide k values, not n
        return g_indices
