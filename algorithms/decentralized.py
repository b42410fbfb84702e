"""Decentralized SGD (D-PSGD, Lian et al. 2017): each rank steps on its own gradient, then averages
its weights with its peers instead of averaging gradients with everyone.

    x <- x - lr * grad(x)                     (the optimizer, no gradient communication)
    every `communication_interval` steps:
        x <- average of x over peers           (ring: both neighbours; shift_one: one partner that
                                                rotates each exchange; all: everyone)
Replicas differ between exchanges by design; under `ring` their spread shrinks geometrically.
"""
from bagua_lite import comm
from bagua_lite.algorithm import Algorithm, register
from bagua_lite.bucket import FlatWeights

PEER_SELECTIONS = ("ring", "shift_one", "all")


@register("decentralized")
class Decentralized(Algorithm):
    def __init__(self, peer_selection: str = "ring", communication_interval: int = 1):
        super().__init__()
        if peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"decentralized: peer_selection={peer_selection!r} is not allowed; "
                             f"choose one of {', '.join(PEER_SELECTIONS)}")
        if communication_interval < 1:
            raise ValueError(f"decentralized: communication_interval must be >= 1, got {communication_interval}")
        self.peer_selection = peer_selection
        self.communication_interval = communication_interval
        self.exchanges = 0

    @property
    def cycle(self):
        return self.communication_interval

    def init(self, model):
        self.weights = FlatWeights(model._params)

    def sync_gradients(self):
        return False

    def after_step(self):
        if self.step % self.communication_interval:
            return
        for flat in self.weights.gather():
            comm.peer_average(flat, self.peer_selection, self.exchanges, group=self.process_group)
        self.weights.scatter()
        self.exchanges += 1

    def state_dict(self):
        return {"step": self.step, "exchanges": self.exchanges}

    def load_state_dict(self, state):
        self.step, self.exchanges = int(state["step"]), int(state["exchanges"])
