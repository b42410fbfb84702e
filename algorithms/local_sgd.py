"""Post-local SGD (Lin et al. 2020): dense gradient averaging for `warmup_steps`, then local steps with
the weights averaged over all ranks every `period` steps.

    step < warmup_steps:  gradients averaged every step (as gradient_allreduce)
    afterwards:           x <- x - lr * local grad;  every `period` steps  x <- mean over ranks of x

``compression``: ``none`` averages the weights themselves; any registered compressor instead averages
each rank's change since the last average, compressed with error feedback (see
:mod:`bagua_lite.averaging`), so ``minmax_uint8`` moves a quarter of the bytes without quantizing weights.
"""
from bagua_lite import cost_model as cm
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.averaging import WeightAverager
from bagua_lite.compressors import get_compressor


@register("local_sgd")
class LocalSGD(Algorithm):
    def __init__(self, period: int = 4, warmup_steps: int = 0, compression: str = "none"):
        super().__init__()
        if period < 1:
            raise ValueError(f"local_sgd: period must be >= 1, got {period}")
        if warmup_steps < 0:
            raise ValueError(f"local_sgd: warmup_steps must be >= 0, got {warmup_steps}")
        get_compressor(compression, "local_sgd")  # validate the name now, before any traffic
        self.period = period
        self.warmup_steps = warmup_steps
        self.compression = compression

    @property
    def cycle(self):
        # warm-up steps are dense, then one weight average every `period` steps
        return 1 if self.step < self.warmup_steps else self.period

    @property
    def step_dependent_wire(self):
        return self.warmup_steps > 0  # what travels changes when the warm-up ends

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """After the warm-up: one weight average every ``period`` steps after the step, nothing overlapped
        (a ring allreduce of the weights, or the compressed allreduce of their change)."""
        n, c = sum(numels), o["compression"]
        local = cm.weight_average_s(c, P, n, machine, apply_passes=1) if machine is not None else 0.0
        return cm.Traffic("after_step", exchange=cm.weight_average(c, P, n, elem_bytes, rank), local_s=local,
                          every=o["period"], warmup=True)

    def init(self, model):
        self.averager = WeightAverager(model.params, self.compression, "local_sgd")

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, True)]

    def sync_gradients(self):
        return self.step < self.warmup_steps

    def after_step(self):
        local_steps = self.step - self.warmup_steps
        if local_steps == 0:
            self.averager.reset_anchor()  # replicas are identical at the end of warm-up
        if local_steps > 0 and local_steps % self.period == 0:
            self.model.run_collective("local_sgd weight average", self._average)  # fails fast on a peer's failure

    def _average(self):
        # ranks average when *their* step count says so: a rank a step ahead would pair its average with
        # the others' one step apart and the replicas would silently differ
        self.model.check_in_step("nothing was averaged")
        self.averager.average(self.process_group)

    def state_dict(self):
        return {"step": self.step, "averager": self.averager.state_dict()}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.averager.load_state_dict(state.get("averager"))
