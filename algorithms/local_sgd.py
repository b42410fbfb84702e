"""Post-local SGD (Lin et al. 2020): dense gradient averaging for `warmup_steps`, then local steps with
the weights averaged over all ranks every `period` steps.

    step < warmup_steps:  gradients averaged every step (as gradient_allreduce)
    afterwards:           x <- x - lr * local grad;  every `period` steps  x <- mean over ranks of x
"""
from bagua_lite import comm
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.bucket import FlatWeights


@register("local_sgd")
class LocalSGD(Algorithm):
    def __init__(self, period: int = 4, warmup_steps: int = 0):
        super().__init__()
        if period < 1:
            raise ValueError(f"local_sgd: period must be >= 1, got {period}")
        if warmup_steps < 0:
            raise ValueError(f"local_sgd: warmup_steps must be >= 0, got {warmup_steps}")
        self.period = period
        self.warmup_steps = warmup_steps

    @property
    def cycle(self):
        # warm-up steps are dense, then one weight average every `period` steps
        return 1 if self.step < self.warmup_steps else self.period

    def init(self, model):
        self.weights = FlatWeights(model._params)

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, True)]

    def sync_gradients(self):
        return self.step < self.warmup_steps

    def after_step(self):
        local_steps = self.step - self.warmup_steps
        if local_steps > 0 and local_steps % self.period == 0:
            for flat in self.weights.gather():
                comm.allreduce(flat, "avg", group=self.process_group)
            self.weights.scatter()
