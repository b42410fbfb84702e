"""Post-local SGD (Lin et al. 2020): dense gradient averaging for `warmup_steps`, then local steps with
the weights averaged over all ranks every `period` steps. It is DiLoCo whose outer step is the plain
average (outer SGD at lr 1, see :mod:`algorithms.diloco`): one code path.

    step < warmup_steps:  gradients averaged every step (as gradient_allreduce)
    afterwards:           x <- x - lr * local grad;  every `period` steps  x <- mean over ranks of x

``compression``: ``none`` averages the weights themselves; any registered compressor instead averages
each rank's change since the last average, compressed with error feedback (see
:mod:`bagua_lite.averaging`), so ``minmax_uint8`` moves a quarter of the bytes without quantizing weights.
``sync_chunks``: the dense average's allreduce in that many pieces, posted at once (see :mod:`algorithms.diloco`).
"""
from bagua_lite.algorithm import register

from .diloco import PLAIN, DiLoCo


@register("local_sgd")
class LocalSGD(DiLoCo):
    def __init__(self, period: int = 4, warmup_steps: int = 0, compression: str = "none", sync_chunks: int = 4):
        super().__init__(period, warmup_steps, compression, PLAIN, sync_chunks=sync_chunks)
