"""The one base class every relaxation subclasses, and the registry that makes it selectable by name.

An algorithm is a handful of hooks (BAGUA's shape, without a config/impl pair per algorithm)::

    @bagua_lite.algorithms.register("my_relaxation")
    class MyRelaxation(bagua_lite.Algorithm):
        def __init__(self, ratio: float = 0.1):
            super().__init__()
            if not 0 < ratio <= 1:
                raise ValueError(f"my_relaxation: ratio must be in (0, 1], got {ratio}")
            self.ratio = ratio

        def bucket_ops(self, bucket):
            # run in order on the engine thread (one intra-op thread) once the bucket's gradients are ready
            return [lambda flat: flat.mul_(2), self.native.AllreduceOp(self.process_group, average=True)]

The contract, every name documented here once. Everything has a default; ``bucket_ops`` (or
``sync_gradients`` and ``after_step``) is what a relaxation usually writes.

**Every algorithm: 34 names.** Hooks, in the order of one training step:

``init(model)``            once, after buckets exist (allocate residuals, build groups)
``bucket_ops(bucket)``     once per bucket: the list of ops that bucket runs each step
``on_gradient(b, j, grad)`` as each gradient is ready: how it goes into its bucket (default: copied into
                           the slot with :meth:`fill`; ``grad`` may already be the slot, or None if it got no
                           gradient)
``before_forward()``       at the start of every forward
``sync_gradients()``       whether this step's gradients go through the bucket ops (default True)
``commit_round()``         after a synchronised backward, once the ranks agreed that every rank's gradient
                           was finite: the round is kept. Most algorithms need none: ``register_state(...,
                           rollback=True)`` tensors are put back by the framework when the round is discarded
                           (some rank's gradient was non-finite: every rank's ``.grad`` is then NaN, so a loss
                           scaler skips the step, and without one ``optimizer.step()`` raises). It is for state
                           that becomes current by a swap (Top-k's double-buffered residuals and momenta) and what
                           a kept round hands to the step (see ``register_working_copies`` for a device verdict)
``undo_round()``           a kept round whose gradients the loop threw away before any step (``zero_grad()``: a
                           GAN's discriminator after the generator's step): undo what ``commit_round`` swapped in
``before_step()``          inside every ``optimizer.step()``, before the optimizer's own update (after the
                           closure, if one was passed, ran its forward and backward)
``after_step()``           after every ``optimizer.step()``; ``step`` counts completed steps
``close()``                by ``DistributedModel.close()``: finish or stop what the algorithm runs on its own
                           (an exchange in flight, a background thread)

State: ``step`` (completed optimizer steps); ``register_state(name, tensors, rollback=, shared=)`` (below:
checkpointed, put back when a round is discarded); ``register_working_copies(pairs)`` (state that ``commit_round``
swaps in: below); ``state_dict()`` / ``load_state_dict()`` for state that is not a list of tensors (counters, an
outer optimizer's state, a decision); ``fill(bucket, j, grad, scale)``, the
default ``on_gradient``'s copy that also records a non-finite gradient; ``native``, the C++ core's bucket ops.

What it declares: ``asynchronous`` (ranks do not wait for each other every step: a benchmark must not
synchronise them per step to time it, and ranks may take different numbers of steps);
``step_dependent_wire`` (what the buckets send depends on the step count, a warm-up or a density schedule:
ranks then compare step counts before any bucket travels); ``cycle`` (steps after which its communication
pattern repeats: 1 for most, a periodic relaxation's period; the benchmark times whole cycles);
``on_shards`` (it runs across the replicas of an FSDP2-sharded model, :class:`bagua_lite.ShardedModel`) and
``check_shards(optimizer)`` (what it refuses there, raised before any traffic); ``device_verdict`` (below);
``grad_holds_update`` (after a kept round ``.grad`` holds more than a gradient, and the round advanced state
from it: a second synchronised backward before the step is refused);
``traffic(options, P, bucket_numels, ...)``, a classmethod describing what it moves, so that the cost model
predicts it and auto can pick it.

What it sees of the model (``model``): ``buckets``, ``params``, ``optimizer``, ``process_group``, ``rank``,
``world_size`` (``process_group`` and ``world_size`` also on the algorithm), ``sharded`` (True under
:class:`bagua_lite.ShardedModel`: buckets and ``params`` are this rank's shards, the group its replicas),
``run_collective("what", fn)`` and ``check_in_step(what)``. Collectives an algorithm runs itself, outside the buckets (a periodic weight
average, a wait for a peer exchange), go through ``run_collective``: ``fn()`` runs on the engine thread while
the training thread waits with fail fast (a peer's failure raises ``PeerFailedError`` within a second, not
after the process group's timeout); a hook that raises tells the peers this model failed.
``check_in_step`` raises on every rank unless all are at the same step count (ahead of a periodic average).

**An algorithm with threads or control traffic of its own: 5 more**, on the model: ``wait_for(event)``,
``check_peers()``, ``peer_failed()`` and ``fail(what)`` (a thread's wait that fails fast, a look for a peer's
failure, telling the peers of one), and ``control_group`` (where small CPU messages go on an NCCL job).

**One that runs another algorithm** (auto): ``model.switch_algorithm(algorithm)`` at a step boundary, and the
classmethod ``predicted_as`` (the cost model predicts what it would run).

**Fault tolerance, only for an algorithm that opts in** (``DistributedModel(..., fault_tolerant=True)``):

``supports_membership_change``  True: it carries on when the group changes (refused otherwise)
``regroup()``              after a peer was lost (or joiners were admitted): the model runs on a new process
                           group and the round in flight was discarded; forget transient per-round state
                           (the framework then asks ``bucket_ops`` again)
``heals_itself``, ``heal()``  it communicates in ``after_step``: a peer lost there keeps the step's update,
                           and ``heal()`` brings the survivors together (a collective on the new group;
                           DiLoCo's and decentralized's are examples)
``replicas_differ``        a joiner takes rank 0's weights while members keep theirs (decentralized)
``store_admission_margin`` for one with no collective of all ranks in its steps: how far ahead of rank 0 the
                           members admit joiners
``admits_joiners``         False while joiners must wait (auto's probe)
``peer_lost()``            before a local step's forward: raise ``PeerFailedError`` if its own thread lost a
                           peer (async averaging)
``shared_state_dict()`` / ``load_shared_state_dict()``  what a joiner takes from rank 0 (default: ``step`` and
                           the state registered with ``shared=True``)
``model.membership``       the membership as such an algorithm sees it (:class:`bagua_lite.elastic.MembershipView`:
                           joining, generation, member id, a step being discarded, gather_ints, share_state,
                           admitting joiners); None without fault tolerance
"""
import functools
import inspect
from typing import Dict, List, Type

import torch

from . import _C
from ._options import check_option_type
from .kept_state import KeptState

_REGISTRY: Dict[str, Type["Algorithm"]] = {}


class Algorithm:
    """Base class of every relaxation. Subclasses take their options as ``__init__`` keyword arguments."""

    #: registry name, set by :func:`register`
    name: str = "algorithm"
    #: ranks do not wait for each other every step (see the module docstring)
    asynchronous: bool = False

    # ---- fault tolerance: only for an algorithm that opts in (supports_membership_change); it sees the
    # membership through ``self.model.membership`` (bagua_lite.elastic.MembershipView), None otherwise ----
    #: can carry on with the survivors when a peer is lost (``DistributedModel(..., fault_tolerant=True)``):
    #: its per-rank state stays consistent when the group shrinks, and :meth:`regroup` forgets the rest
    supports_membership_change: bool = False
    #: the ranks' weights differ by design (decentralized): a joiner starts from rank 0's, each member keeps its own
    replicas_differ: bool = False
    #: with ``fault_tolerant=True``, for an algorithm with no collective of all ranks in its steps (where the
    #: step agreement carries a joiner's news): how many steps ahead of rank 0's count members admit joiners,
    #: more than any member can be ahead of it (each reads the admission step from the store once per step);
    #: None: admitted by the agreement
    store_admission_margin = None
    #: communicates in ``after_step`` (local SGD, DiLoCo, decentralized): a peer lost there keeps that step's
    #: update and the survivors are brought together by :meth:`heal` instead of discarding a round
    heals_itself: bool = False
    admits_joiners: bool = True  # whether workers waiting to join may be admitted now (auto says no while it probes)
    #: runs across the replicas of an FSDP2-sharded model (ShardedModel: a bucket per unit, params the shards)
    on_shards: bool = False
    #: how a GPU round's non-finite verdict may stay on the device (bagua_lite.verdict): "result" (equal on every
    #: rank, inf/NaN where any rank's gradient was), "flags" (state put back there: rollback=True, working copies),
    #: "" (read on the host)
    device_verdict: str = ""

    @property
    def grad_holds_update(self) -> bool:
        """After a kept round ``.grad`` holds more than an average of gradients and the round advanced state
        from them (momentum correction's corrected update, qadam's averaged momentum): another synchronised
        backward before the step would add a gradient to it, or after a ``zero_grad`` count the first one's
        momentum as well, so it is refused (accumulate under ``no_sync()``). Default False: ``.grad`` is an
        average of gradients, and a second backward adds to it as under DDP."""
        return False

    def __init__(self):
        self.step = 0
        self.model = None
        #: buckets whose incoming gradient held inf/NaN on this rank in the current round
        self.nonfinite_buckets = set()
        #: what :meth:`register_state` declared (the framework's side of it: rollback, snapshots)
        self.kept_state = KeptState()

    def __init_subclass__(cls, **kwargs):
        """Record the options of every instance, however it is made (``build(...)`` or ``GTopK(...)``), so
        the cross-rank config check and ``repr`` see them: the outermost ``__init__`` binds its arguments."""
        super().__init_subclass__(**kwargs)
        if "discard_round" in cls.__dict__:  # a hook no longer called: refuse it rather than ignore it
            raise TypeError(f"{cls.__qualname__}: discard_round is not a hook any more; declare the state a "
                            f"discarded round must put back with self.register_state(name, tensors, "
                            f"rollback=True) in init(), and the framework copies it back")
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def recorded(self, *args, **kw):
            outer = not self.__dict__.get("_binding", False)
            self.__dict__["_binding"] = True
            try:
                init(self, *args, **kw)
            finally:
                if outer:
                    del self.__dict__["_binding"]
            if outer:
                bound = inspect.signature(init).bind(self, *args, **kw)
                bound.apply_defaults()
                params = inspect.signature(init).parameters
                self._options = {k: v for k, v in bound.arguments.items()
                                 if k != "self" and params[k].kind in (params[k].POSITIONAL_OR_KEYWORD,
                                                                       params[k].KEYWORD_ONLY)}
        cls.__init__ = recorded

    # ---- set-up ----------------------------------------------------------------------------------------
    def init(self, model) -> None:
        """Called once by :class:`~bagua_lite.DistributedModel` after it built the buckets."""

    def check_shards(self, optimizer) -> None:
        """Raise for what it cannot do on shards with ``optimizer`` (ShardedModel asks before any traffic)."""

    def bucket_ops(self, bucket) -> List:
        """The ops (``bagua_lite._C.Op`` or callables taking the flat bucket tensor) of one bucket."""
        return []

    # ---- per step ----------------------------------------------------------------------------------------
    def on_gradient(self, bucket, position: int, grad) -> None:
        """Put parameter ``position``'s ready gradient into ``bucket`` (runs on the autograd thread).

        Afterwards the parameter's ``.grad`` becomes ``bucket.view(position)``, and once the bucket is
        complete its ops run on the flat buffer. A relaxation that keeps its own accumulator (error
        feedback) can add ``grad`` there instead and save a pass over the model.
        """
        self.fill(bucket, position, grad)

    def fill(self, bucket, position: int, grad, scale: float = 1.0) -> bool:
        """``fill_slot`` that also checks ``grad`` for inf/NaN in the same pass and records the bucket in
        ``nonfinite_buckets`` if so. Returns whether ``grad`` was finite."""
        if bucket.fill(position, grad, scale):
            return True
        self.nonfinite_buckets.add(bucket.index)
        return False

    @property
    def step_dependent_wire(self) -> bool:
        """Whether what a step's buckets send (message sizes, which collectives) depends on the step count:
        a warm-up, a density schedule. Then every synchronised backward first checks, before any bucket
        travels, that all ranks are at the same step (an extra small collective per step): a rank out of
        step would otherwise pair collectives of different sizes, which gloo answers with an abort.
        Otherwise the step count rides in the one agreement after the buckets, and a rank out of step
        is still reported before anything is applied. Must be the same on every rank (a function of the
        options only). The default assumes it does; built-ins say False where it cannot."""
        return True

    @property
    def cycle(self) -> int:
        """Steps after which the per-step communication pattern repeats (1: every step is alike)."""
        return 1

    def sync_gradients(self) -> bool:
        """Whether the gradients of the current step are communicated (must be the same on all ranks)."""
        return True

    def before_forward(self) -> None:
        pass

    def before_step(self) -> None:
        """Inside ``optimizer.step()``, before the optimizer's update: after a closure's forward and backward
        and after the model's refusals (non-finite round, ranks out of step). If the optimizer's update
        raises, ``after_step`` does not run and the next ``before_step`` or ``before_forward`` comes first."""

    def after_step(self) -> None:
        pass

    def commit_round(self) -> None:
        """Every rank's gradient was finite: the round is kept (see the module docstring for who needs this;
        a discarded round needs no hook: ``register_state(..., rollback=True)`` state is put back)."""

    def undo_round(self) -> None:
        """Undo :meth:`commit_round` (rollback=True state is put back already; never where grad_holds_update)."""

    def regroup(self) -> None:
        """With ``fault_tolerant=True``: the model now runs on the survivors' new group and the round in
        flight was discarded (``register_state(..., rollback=True)`` tensors already put back, buckets
        zeroed). Forget what the discarded round left half-done; ``bucket_ops`` is asked again after this."""

    def heal(self) -> None:
        """With ``fault_tolerant=True`` and ``heals_itself``: after a lost peer, on the survivors' new group (a
        collective of theirs), bring their state together (the survivors may be a step or an exchange apart)."""
        raise NotImplementedError(f"{type(self).__qualname__} sets heals_itself but defines no heal()")

    def peer_lost(self) -> None:
        """With ``fault_tolerant=True``, before the forward of a step whose backward runs no collective (a
        local step): raise ``PeerFailedError`` if the algorithm's own communication (a background thread's)
        failed, so the survivors re-form there and discard that step. Nothing to look at by default."""

    def close(self) -> None:
        """Called once by ``DistributedModel.close()``: end anything the algorithm runs by itself."""

    # ---- state -------------------------------------------------------------------------------------------
    def register_state(self, name: str, tensors: List[torch.Tensor], rollback: bool = False,
                       shared: bool = False) -> None:
        """Declare per-rank state (error-feedback residuals, momenta) that the framework keeps for you: it
        is in ``state_dict()`` and restored by ``load_state_dict()`` (so checkpoints resume it bit for bit),
        and with ``rollback=True`` it is copied before every synchronised round and copied back when the
        round is discarded (some rank's gradient was non-finite), into buffers allocated once.
        ``shared=True``: the same on every rank (PowerSGD's Q's), so a worker joining a fault-tolerant job
        copies it from a peer; per-rank state (the default) starts as ``init`` left it on a joiner."""
        if not isinstance(name, str) or not name or name == "step":
            raise ValueError(f"{self.name}: register_state needs a name other than 'step', got {name!r}")
        tensors = list(tensors)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(f"{self.name}: register_state({name!r}) takes a list of tensors")
        self.kept_state.add(name, tensors, rollback, shared)

    def register_working_copies(self, pairs) -> None:
        """State that :meth:`commit_round` swaps in (Top-k's double buffers), under ``device_verdict = "flags"``:
        ``pairs()`` gives [(working copy, the state it replaces)], alike and contiguous. Where the flags agreed on
        the device discard the round, each state is copied over its working copy there (no host read), so the
        swap the host then makes in ``commit_round``, called for every such round, keeps the state."""
        if not callable(pairs):
            raise TypeError(f"{self.name}: register_working_copies takes a callable, got {type(pairs).__name__}")
        self.kept_state.add_working(pairs)

    def state_dict(self) -> dict:
        """The step count and every :meth:`register_state` tensor (copies)."""
        state = {"step": self.step}
        for name, tensors in self.kept_state.items():
            state[name] = [t.clone() for t in tensors]
        return state

    def shared_state_dict(self) -> dict:
        """What a worker joining a fault-tolerant job takes from a peer: the step count and the state
        registered with ``shared=True``."""
        return {"step": self.step, **{n: self.kept_state.tensors(n) for n in self.kept_state.shared()}}

    def load_shared_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        for name in self.kept_state.shared():
            for t, s in zip(self.kept_state.tensors(name), state[name]):
                t.copy_(s)

    def load_state_dict(self, state: dict) -> None:
        """The step count and every :meth:`register_state` tensor, checked before anything is copied."""
        for name, tensors in self.kept_state.items():
            saved = state.get(name)
            if saved is None or len(saved) != len(tensors) or any(t.shape != s.shape for t, s in zip(tensors, saved)):
                raise ValueError(f"{self.name}: the saved state has no {name!r} of {len(tensors)} tensors shaped "
                                 f"as this model's (saved for another model or other options?)")
        self.step = int(state["step"])
        for name, tensors in self.kept_state.items():
            for t, s in zip(tensors, state[name]):
                t.copy_(s)

    # ---- conveniences for subclasses -----------------------------------------------------------------
    @property
    def process_group(self):
        return self.model.process_group

    @property
    def world_size(self) -> int:
        return self.model.world_size

    @property
    def native(self):
        """The C++ core's native bucket ops (``AllreduceOp``, ``CompressedAllreduceOp``): GIL-free on the engine."""
        return _C

    @classmethod
    def traffic(cls, options: dict, P: int, bucket_numels: List[int], elem_bytes: int = 4, machine=None,
                rank=None):
        """What this algorithm moves per step on ``P`` ranks and the local work around it, as a
        :class:`bagua_lite.cost_model.Traffic` (``options``: every option, defaults filled in; ``machine``:
        the per-element costs, None when only bytes are asked; ``rank``: whose bytes, None for the
        busiest). The cost model times it with its network and machine formulas, so an algorithm that
        describes its traffic is predicted, compared in the benchmark and can be one of auto's candidates.
        Not described by default (the cost model then says it cannot predict it)."""
        raise NotImplementedError(f"{cls.name} does not describe its traffic")

    @classmethod
    def predicted_as(cls, options: dict, P: int, work, net, machine):
        """For an algorithm that runs another one it picks (auto): ``(name, options, extra)`` of the one it
        would run with these ``options`` on ``P`` ranks under this ``work``, ``net`` and ``machine``, which
        the cost model predicts instead (``extra`` joins the prediction; an ``efficiency`` there also gives
        ``weighted_s``). None (the default): predicted from :meth:`traffic`."""
        return None

    def options(self) -> dict:
        """The options this instance was built with (used to check all ranks run the same config)."""
        return dict(getattr(self, "_options", {}))

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options().items()))
        return f"{type(self).__name__}({opts})"


def fill_slot(view, grad, scale: float = 1.0) -> None:
    """Put ``grad * scale`` into a bucket slot in one pass (``grad`` None: zeros; ``grad`` may be the slot).
    :meth:`Algorithm.fill` does the same and checks for inf/NaN on the way."""
    if grad is None:
        view.zero_()
    elif grad.data_ptr() == view.data_ptr():
        if scale != 1.0:
            view.mul_(scale)
    elif scale != 1.0:
        torch.mul(grad, scale, out=view)
    else:
        view.copy_(grad)


def register(name: str):
    """Class decorator: make an :class:`Algorithm` subclass selectable by ``name`` (in YAML too)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise TypeError(f"register({name!r}): {cls!r} is not a subclass of bagua_lite.Algorithm")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"register: an algorithm named {name!r} is already registered "
                             f"({_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registered() -> List[str]:
    return sorted(_REGISTRY)


def registered_class(name: str):
    """The class registered as ``name``, or None."""
    return _REGISTRY.get(name)


def option_names(cls) -> List[str]:
    sig = inspect.signature(cls.__init__)
    return [p for p, v in sig.parameters.items() if p != "self" and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]


def build(name: str, **options) -> Algorithm:
    """Instantiate a registered algorithm by name with keyword options, validating names and types."""
    import difflib

    if not isinstance(name, str) or name not in _REGISTRY:  # a dict is unhashable: name it, not TypeError
        raise ValueError(f"unknown algorithm {name!r}; known algorithms: {', '.join(registered())}")
    cls = _REGISTRY[name]
    allowed = option_names(cls)
    sig = inspect.signature(cls.__init__)
    for key, value in options.items():
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"algorithm {name!r}: unknown option {key!r}{hint} "
                             f"(allowed: {', '.join(allowed) or 'none'})")
        default = sig.parameters[key].default
        check_option_type(name, key, value, default)
    alg = cls(**options)
    full = {k: sig.parameters[k].default for k in allowed if sig.parameters[k].default is not inspect._empty}
    full.update(options)
    alg._options = full
    return alg
