"""DiLoCo (Douillard et al., arXiv 2311.08105): H inner steps of the user's optimizer on each rank, then an
outer optimizer step on the averaged pseudo-gradient. Local SGD is its special case, outer SGD at lr 1.

    step < warmup_steps:      gradients averaged every step (dense, as gradient_allreduce)
    every ``period`` (H) steps after that, with theta the weights at the last sync (the anchor):
        delta   <- mean over ranks of (theta - x_r)     (the pseudo-gradient; ``compression``: the change
                                                          x_r - theta travels compressed, with error feedback)
        theta   <- OuterOpt(theta, delta)               (default SGD, lr 0.7, Nesterov momentum 0.9)
        x_r     <- theta                                (every replica: identical)

Streaming DiLoCo (arXiv 2501.18512) are options of the same class: ``fragments`` F splits the parameters
into F contiguous parts of about equal size, each with its own anchor and outer optimizer; fragment f
syncs at the local steps s with ``(s - f*H//F) % H == 0``. ``overlap`` tau > 0 runs that sync on a thread
of its own while training goes on for tau more steps, then merges it: ``x_f <- alpha * x_f + (1 - alpha) *
theta_f`` (``alpha`` 0: the replicas' fragment is theta_f, identical everywhere). Peak traffic is 1/F of a
full sync, and with tau > 0 no step waits for the network unless the sync outlasts tau steps.

``sync_chunks`` k: a dense sync allreduces each flat buffer (per fragment) as k nearly equal contiguous pieces,
all posted before any is waited for: gloo runs two collectives at once (2 worker threads per process group),
so one piece's reduction overlaps another's transfer (1: one allreduce, the behaviour before the option).
The pieces depend on the buffer's length only, the same on every rank; a compressed sync is unchanged. On
3 or more ranks the ring rounds each sum by where the element falls in the piece, so k changes the last bits.
Default 4: at P=4, 25M floats (benchmarks/bench_sync_chunks.py) 1-1.5% faster than 1 at 100 Mbit/s, equal
at 1 Gbit/s (one allreduce already runs at the link's goodput), 3% slower on loopback (CPU-bound, within
its noise); 8 is slower everywhere.

``outer_optimizer``: ``{name: <a torch.optim class, any case>, <its keyword arguments>}``. Its state (momentum)
and the anchor, and a sync still in flight, are in ``state_dict()``, so a resumed run continues bit for bit.
"""
import torch

from bagua_lite.algorithm import Algorithm, register
from bagua_lite.averaging import WeightAverager
from bagua_lite.compressors import get_compressor

from .parts.diloco_membership import DiLoCoMembership
from .parts.family import (DEFAULT_OUTER, PLAIN, check_options, check_sync_chunks, family_traffic,  # noqa: F401
                      outer_optimizer_class, plain_average)
from .parts.streaming import Background, Sync, split


@register("diloco")
class DiLoCo(DiLoCoMembership, Algorithm):
    def __init__(self, period: int = 500, warmup_steps: int = 0, compression: str = "none",
                 outer_optimizer: dict = None, fragments: int = 1, overlap: int = 0, alpha: float = 0.0,
                 sync_chunks: int = 4):
        super().__init__()
        check_options(self.name, period, warmup_steps, fragments, overlap, alpha)
        check_sync_chunks(self.name, sync_chunks)
        get_compressor(compression, self.name)  # validate the name now, before any traffic
        self.period, self.warmup_steps, self.compression = period, warmup_steps, compression
        self.fragments, self.overlap, self.alpha = fragments, overlap, float(alpha)
        self.sync_chunks = sync_chunks
        self.outer_spec = dict(DEFAULT_OUTER if outer_optimizer is None else outer_optimizer)
        self._outer_class = outer_optimizer_class(self.outer_spec, self.name)
        self.outers, self.pending, self.background = [], {}, None
        self._syncing = None  # the fragment whose in-step sync is running (fault tolerance: heal())
        self._syncs = 0       # in-step syncs completed (fault tolerance: who has the last one's result)
        self._merges = [0] * fragments  # background syncs merged, per fragment (fault tolerance, overlap)

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
        return family_traffic(o, P, numels, elem_bytes, machine, rank)

    on_shards = True  # the weights it averages are the local shards, the same piece on every replica's rank s

    def init(self, model):
        if len(model.params) < self.fragments:
            raise ValueError(f"{self.name}: fragments={self.fragments} but the model has {len(model.params)} "
                             f"parameter tensors; use at most that many fragments")
        anchored = not self.plain_average() or self.overlap > 0
        owners = dict(zip(map(id, model.params), getattr(model, "owners", model.params)))  # shards: their DTensor
        self.frags = [WeightAverager(part, self.compression, self.name, anchored=anchored, chunks=self.sync_chunks,
                                     owners=owners)
                      for part in (split(model.params, self.fragments) if self.fragments > 1 else [model.params])]
        self.offsets = [f * self.period // self.fragments for f in range(self.fragments)]
        if not self.plain_average():
            cls, kwargs = self._outer_class
            self.outers = [cls(frag.anchors, **kwargs) for frag in self.frags]  # the anchors are what it steps
        if self.overlap:
            self.background = Background(model, self.name)  # collective (a process group of its own)
        # fault tolerance with compression: the residuals before an in-step sync, put back if a lost peer
        # makes the survivors send again (buffers made once, copied once per sync)
        self._residuals_before = [[r.clone() for r in frag.residuals] for frag in self.frags] \
            if model.membership is not None and self.frags[0].compressor is not None else []

    @property
    def averager(self):
        """The first fragment's weight averager (the only one unless ``fragments`` > 1)."""
        return self.frags[0]

    def bucket_ops(self, bucket):
        return [self.native.AllreduceOp(self.process_group, True)]

    def sync_gradients(self):
        return self.step < self.warmup_steps

    def after_step(self):
        s = self.step - self.warmup_steps  # local steps taken
        if s == 0:
            for frag in self.frags:
                frag.reset_anchor()  # replicas are identical at the end of warm-up
        for f in [f for f, job in self.pending.items() if job.step - self.warmup_steps + self.overlap == s]:
            self._merge(f)
        for f, offset in enumerate(self.offsets):
            if s > 0 and (s - offset) % self.period == 0:
                if self.overlap:
                    self.frags[f].take_change()
                    self.pending[f] = self.background.submit(self.frags[f].reduce_work, self.step)
                else:  # fails fast on a peer's failure
                    if self._residuals_before:
                        for before, residual in zip(self._residuals_before[f], self.frags[f].residuals):
                            before.copy_(residual)
                    self._syncing = f
                    self.model.run_collective(f"{self.name} sync", lambda f=f: self._sync_now(f))
                    self._syncing, self._syncs = None, self._syncs + 1
        membership = self.model.membership
        if self.pending and membership is not None and membership.admitting:
            for f, job in self.pending.items():  # joiners are admitted after this step: the syncs in flight
                job.wait(self.model, f"{self.name}: fragment {f}'s sync")  # finish on the old group first

    def _sync_now(self, f):
        # ranks sync when *their* step count says so: a rank a step ahead would pair its sync with the
        # others' one step apart and the replicas would silently differ
        frag, what = self.frags[f], "nothing was averaged"
        if frag.compressor is not None:  # its error feedback changes as it travels: the check goes first
            self.model.check_in_step(what)
            frag.reduce_change(self.process_group)
        else:  # dense: the data leaves first, the check travels beside it; nothing is applied before it passes
            pending = frag.start_sync(self.process_group)
            try:
                self.model.check_in_step(what)
            finally:
                pending.wait()
        self._apply(f) if frag.anchored else frag.apply(delta=False)

    def _merge(self, f):
        self.pending.pop(f).wait(self.model, f"{self.name}: fragment {f}'s sync")  # raises on every rank if bad
        self._apply(f)
        self._merges[f] += 1

    def _apply(self, f):
        """theta_f <- the outer step on the averaged change in the work buffers; x_f <- theta_f (mixed)."""
        frag = self.frags[f]
        for anchor, change in zip(frag.anchors, frag.work):
            if self.outers:
                anchor.grad = change.neg_()  # the pseudo-gradient: theta - mean x
            else:
                anchor.add_(change)  # plain averaging: theta + mean (x - theta)
        if self.outers:
            spans = frag.frozen_spans()
            held = _hold(self.outers[f], frag.anchors, spans) if spans else None
            self.outers[f].step()
            if held:
                _release(self.outers[f], frag.anchors, spans, held)
        frag.load_anchor(self.alpha if self.overlap else 0.0)

    def close(self):
        if self.background is not None:  # the syncs in flight finish, so no peer is left waiting; after a
            self.background.stop(give_up=self.model.peer_failed)  # peer's failure the exit hook waits instead

    def state_dict(self):
        for job in self.pending.values():
            self.model.wait_for(job.done, job.step)  # what a sync in flight brings back is part of the state
        return {"step": self.step, "fragments": [
            {"averager": frag.state_dict(), "outer": self.outers[f].state_dict() if self.outers else None,
             "pending": self.pending[f].saved(frag.work) if f in self.pending else None}
            for f, frag in enumerate(self.frags)]}

    def load_state_dict(self, state):
        if len(state["fragments"]) != len(self.frags):
            raise ValueError(f"{self.name}: the saved state has {len(state['fragments'])} fragments, this run "
                             f"{len(self.frags)}")
        self.step, self.pending = int(state["step"]), {}
        for f, (frag, saved) in enumerate(zip(self.frags, state["fragments"])):
            frag.load_state_dict(saved["averager"])
            if self.outers:
                self.outers[f].load_state_dict(saved["outer"])
            if saved["pending"] is not None:  # a sync in flight when saved: merged at its step, as it was
                self.pending[f] = Sync.restored(saved["pending"], frag.work)


# A parameter frozen after wrapping (requires_grad False now) is left alone by the user's optimizer (its .grad
# is None), and must be by the outer one too: its momentum would go on moving it. At a sync it takes the
# replicas' mean change as is (outer lr 1, no momentum), so replicas frozen mid-period still end it identical,
# and a parameter frozen for a whole period, uncompressed, does not move; its outer state is kept as it was
# (zero where the outer optimizer had none yet, as its own initial state) and resumes once it is unfrozen:
# what torch's optimizers do for a parameter whose .grad is None.
def _hold(outer, anchors, spans):
    """The frozen spans' anchor slices and outer-state slices, before the outer step."""
    return [(anchors[g][o:o + n].clone(), {key: t[o:o + n].clone() for key, t in _flat_state(outer, anchors[g])})
            for g, o, n in spans]


def _release(outer, anchors, spans, held):
    """After the outer step: each frozen span's anchor is its old one plus the mean change (the work buffer
    holds its negation, the pseudo-gradient), its outer state what it was."""
    for (g, o, n), (anchor, state) in zip(spans, held):
        torch.sub(anchor, anchors[g].grad[o:o + n], out=anchors[g][o:o + n])
        for key, t in _flat_state(outer, anchors[g]):
            t[o:o + n].copy_(state[key]) if key in state else t[o:o + n].zero_()


def _flat_state(outer, anchor):
    """The outer optimizer's per-element state of one flat anchor (momentum, Adam's moments; not step counts)."""
    return [(key, t) for key, t in outer.state.get(anchor, {}).items()
            if torch.is_tensor(t) and t.shape == anchor.shape]
