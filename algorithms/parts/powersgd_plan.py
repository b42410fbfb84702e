"""Which of a bucket's tensors PowerSGD compresses, and the cost model's view of its traffic (``powersgd``).

A tensor of shape (n, ...) is viewed as an n x m matrix (m = the rest) and compressed to rank r if that
saves at least ``min_compression_rate`` times: n m >= rate (n + m) r. Vectors and smaller matrices travel
dense. The algorithm (on real parameters) and the cost model (on ``bucket_shapes``, or one square-ish
matrix per bucket) decide with the same rule.
"""
import math

from bagua_lite import cost_model as cm


def compressible(shape, rank, rate) -> bool:
    """Whether a tensor of ``shape`` is compressed at ``rank`` and ``min_compression_rate`` ``rate``."""
    if len(shape) < 2 or shape[0] <= 0:
        return False
    n, m = shape[0], math.prod(shape) // shape[0]
    return n * m >= rate * (n + m) * rank


def plan(o, n, index):
    """(r, [(rows, cols) of each compressed matrix], dense elements) of bucket ``index`` of n elements, for
    the cost model: from ``bucket_shapes`` exactly as the algorithm splits a bucket, else one matrix."""
    r, rate = int(o["rank"]), float(o["min_compression_rate"])
    if o.get("bucket_shapes") is not None:
        shapes = o["bucket_shapes"]
        if index is None or index >= len(shapes):
            raise ValueError("cost_model: powersgd: bucket_shapes must list every bucket's parameter shapes")
        mats, dense = [], 0
        for s in shapes[index]:
            s = [int(d) for d in s]
            if compressible(s, r, rate):
                mats.append((s[0], math.prod(s) // s[0]))
            else:
                dense += math.prod(s)
        if sum(a * b for a, b in mats) + dense != n:
            raise ValueError(f"cost_model: powersgd: bucket_shapes[{index}] holds "
                             f"{sum(a * b for a, b in mats) + dense} elements, the bucket {n}")
        return r, mats, dense
    rows = cm.side(n)
    cols = n // rows
    if compressible((rows, cols), r, rate):
        return r, [(rows, cols)], n - rows * cols
    return r, [], n


def traffic(o, P, numels, elem_bytes=4, machine=None, rank=None):
    """After the warm-up, per bucket on the engine: an allreduce of the P factors, then of [Q factors |
    the dense rest]. Local per matrix of N elements: the error feedback add, M Q, M^T P, M - P Q^T and
    P Q^T (each at least a pass), the QR of P; the dense rest in and out of the wire. Shapes: the
    cost-model-only option ``bucket_shapes`` (each bucket's parameter shapes), else one matrix per
    bucket of round(sqrt n) rows."""
    e = elem_bytes

    def comm_(n, i):
        r, mats, dense = plan(o, n, i)
        p_elems, q_elems = sum(a * r for a, _ in mats), sum(b * r for _, b in mats)
        parts = ([cm.ring(p_elems * e, P)] if mats else []) + \
            ([cm.ring((q_elems + dense) * e, P)] if q_elems + dense else [])
        return tuple(sum(x[j] for x in parts) for j in range(3))

    def local(n, i):
        r, mats, dense = plan(o, n, i)
        add, flop, t = machine.add_s_per_elem, machine.matmul_s_per_flop, 0.0
        for rows, cols in mats:
            N = rows * cols
            t += N * add + 4 * max(2.0 * N * r * flop, N * add) + 2.0 * rows * r * r * flop
        return t + (3 * dense + sum(cols * r for _, cols in mats)) * add
    return cm.Traffic("buckets", *cm.per_bucket(numels, P, comm_, local, machine), warmup=True)
