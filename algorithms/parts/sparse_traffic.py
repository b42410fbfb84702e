"""The cost model's view of a Top-k or gTop-k bucket (``ErrorFeedbackSparsifier.traffic``)."""
from bagua_lite import cost_model as cm


def sparsifier_traffic(sparse_traffic, o, P, numels, elem_bytes=4, machine=None, rank=None):
    """Per bucket on the engine, overlapped with backward: the selection of k = density n entries (at
    the bounded rate where the bucket has block maxima: one selection, k at most a quarter of its
    64-entry blocks), error feedback and the output's clearing (2 passes), momentum correction (a
    pass, unless momentum_correction is 0), and the subclass's exchange: ``sparse_traffic(o, P, k,
    elem_bytes, rank, machine, n)``, its (message triple, local seconds after the selection)."""
    def comm_(n, i):
        return sparse_traffic(o, P, cm.k_of(o["density"], n), elem_bytes, rank, n=n)[0]

    def local(n, i):
        add, k = machine.add_s_per_elem, cm.k_of(o["density"], n)
        mc = 0.0 if o["momentum_correction"] == 0 else n * add
        bounded = machine.topk_bounded_s_per_elem and not o["layerwise"] and 4 * k <= -(-n // 64)
        select = n * (machine.topk_bounded_s_per_elem if bounded else machine.topk_s_per_elem)
        return select + 2 * n * add + mc + sparse_traffic(o, P, k, elem_bytes, rank, machine, n)[1]
    return cm.Traffic("buckets", *cm.per_bucket(numels, P, comm_, local, machine))
