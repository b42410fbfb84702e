"""DiLoCo (Douillard et al., arXiv 2311.08105): H inner steps of the user's optimizer on each rank, then an
outer optimizer step on the averaged pseudo-gradient. Local SGD is its special case, outer SGD at lr 1.

    step < warmup_steps:      gradients averaged every step (dense, as gradient_allreduce)
    every ``period`` (H) steps after that, with theta the weights at the last sync (the anchor):
        delta   <- mean over ranks of (theta - x_r)     (the pseudo-gradient; ``compression``: the change
                                                          x_r - theta travels compressed, with error feedback)
        theta   <- OuterOpt(theta, delta)               (default SGD, lr 0.7, Nesterov momentum 0.9)
        x_r     <- theta                                (every replica: identical)

``outer_optimizer``: ``{name: <a torch.optim class, any case>, <its keyword arguments>}``. Its state (momentum)
and the anchor are in ``state_dict()``, so a resumed run continues bit for bit.
"""
import inspect

import torch

from bagua_lite import cost_model as cm
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.averaging import WeightAverager
from bagua_lite.compressors import get_compressor

DEFAULT_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
PLAIN = {"name": "sgd", "lr": 1.0}  # the outer step that is the average itself: local SGD


def plain_average(spec) -> bool:
    """Outer SGD at lr 1 without momentum or decay sets theta to the mean of the replicas: it is taken as
    that average (local SGD's exact path), not as theta - (theta - mean)."""
    spec = DEFAULT_OUTER if spec is None else spec
    rest = {k: v for k, v in spec.items() if k not in ("name", "lr")}
    return spec.get("name", "").lower() == "sgd" and spec.get("lr") == 1 and not any(rest.values())


def outer_optimizer_class(spec, who):
    """(torch.optim class, keyword arguments) of an ``outer_optimizer`` option, checked by building it."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{who}: outer_optimizer must be {{name: <torch.optim class>, <its options>}}, got {spec!r}")
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    cls = classes.get(spec["name"].lower())
    if cls is None or cls is torch.optim.LBFGS:
        raise ValueError(f"{who}: outer_optimizer name {spec['name']!r} is not a torch.optim optimizer; choose one "
                         f"of {', '.join(sorted(n for n in classes if n != 'lbfgs'))}")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    try:
        cls([torch.zeros(1)], **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: outer_optimizer {spec!r}: {e}") from None
    return cls, kwargs


@register("diloco")
class DiLoCo(Algorithm):
    def __init__(self, period: int = 500, warmup_steps: int = 0, compression: str = "none",
                 outer_optimizer: dict = None):
        super().__init__()
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"{self.name}: period must be >= 1, got {period!r}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"{self.name}: warmup_steps must be >= 0, got {warmup_steps!r}")
        get_compressor(compression, self.name)  # validate the name now, before any traffic
        self.period, self.warmup_steps, self.compression = period, warmup_steps, compression
        self.outer_spec = dict(DEFAULT_OUTER if outer_optimizer is None else outer_optimizer)
        self._outer_class = outer_optimizer_class(self.outer_spec, self.name)
        self.outer = None

    def plain_average(self) -> bool:
        return plain_average(self.outer_spec)

    @property
    def cycle(self):
        return 1 if self.step < self.warmup_steps else self.period

    @property
    def step_dependent_wire(self):
        return self.warmup_steps > 0  # what travels changes when the warm-up ends

    @classmethod
    def traffic(cls, o, P, numels, elem_bytes=4, machine=None, rank=None):
        """After the warm-up: one exchange every ``period`` steps after the step, nothing overlapped (a ring
        allreduce of the weights or of their change, or the compressed allreduce of the change); an outer
        optimizer adds a few passes over the weights (the pseudo-gradient, its step, the copy back)."""
        n, c = sum(numels), o["compression"]
        local = 0.0
        if machine is not None:
            local = cm.weight_average_s(c, P, n, machine, apply_passes=1)
            if not plain_average(o.get("outer_optimizer", PLAIN)):
                local += 4 * n * machine.add_s_per_elem
        return cm.Traffic("after_step", exchange=cm.weight_average(c, P, n, elem_bytes, rank), local_s=local,
                          every=o["period"], warmup=True)

    def init(self, model):
        self.averager = WeightAverager(model.params, self.compression, self.name, anchored=not self.plain_average())
        if not self.plain_average():
            cls, kwargs = self._outer_class
            self.outer = cls(self.averager.anchors, **kwargs)  # the anchor theta is what it steps

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, True)]

    def sync_gradients(self):
        return self.step < self.warmup_steps

    def after_step(self):
        local_steps = self.step - self.warmup_steps
        if local_steps == 0:
            self.averager.reset_anchor()  # replicas are identical at the end of warm-up
        if local_steps > 0 and local_steps % self.period == 0:
            self.model.run_collective(f"{self.name} sync", self._sync)  # fails fast on a peer's failure

    def _sync(self):
        # ranks sync when *their* step count says so: a rank a step ahead would pair its sync with the
        # others' one step apart and the replicas would silently differ
        self.model.check_in_step("nothing was averaged")
        if self.outer is None:
            self.averager.average(self.process_group)
            return
        for anchor, change in zip(self.averager.anchors, self.averager.reduce_change(self.process_group)):
            anchor.grad = change.neg_()  # the pseudo-gradient: theta - mean x
        self.outer.step()
        self.averager.load_anchor()

    def state_dict(self):
        state = {"step": self.step, "averager": self.averager.state_dict()}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.averager.load_state_dict(state.get("averager"))
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
