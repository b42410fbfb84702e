"""Auto: run the relaxation that the cost model predicts reaches the accuracy first for this model, network and P.

    set-up:                 network <- probe_network()  (ping-pong between ranks 0 and 1; or the
                                                         ``network`` option, e.g. an emulated link)
                            machine <- calibrate_machine()  (topk, quantize, fp16, add per element)
    steps 1..probe_steps:   local SGD: every rank steps on its own gradient, nothing travels in the
                            buckets, so the compute is measured clean:
                            compute <- wall(forward .. optimizer.step)
                            after each probe step but the last, one small all_gather (the step counts);
                            from the second on, timed: machine.round_s <- mean wait (a synchronous
                            round's fixed cost: the small collective our rounds add and, on shared
                            cores, waiting for the peers to be scheduled; the first round absorbs how
                            far apart the ranks started)
    after the last probe:   inputs <- max over ranks            (one collective; one decision on every rank)
                            pick   <- cost_model.choose(candidates, P, workload, network, machine,
                                                        efficiency)   (by time to accuracy, below)
                            replicas: a pick that needs identical replicas (everything but local SGD
                            without warm-up or compression, and uncompressed decentralized SGD) first gets the average
                            of the parameters and of the optimizer's state (momentum, Adam's moments) on
                            every rank: one allreduce, as a local SGD average; the others go on from
                            where their probe steps left them, as they would on their own
                            log one line: the pick, every candidate's s/step x efficiency, the inputs
    from then on:           the model runs the pick (auto hands it over); its step count is the
                            training's (the probe steps count as its first steps), so its schedule keeps
                            the phase it has on its own: local SGD averages after steps H, 2H, ... (H its
                            period), and with local SGD picked the whole run is local SGD's own
                            trajectory, bit for bit (tested), at the cost of the probe's collectives

Probing with local steps costs a pick that communicates every step one average of the weights and the
optimizer's state, about what the 2 dense steps cost that the probe used to take (the probe is now 3 steps,
with 2 small collectives and the decision's); it costs local SGD only those 3 small collectives (on digits
at P = 4 the dense probe steps and their rounds made auto's first 4 steps 2-3x local SGD's, and changed
its trajectory).

Ranked by predicted time to accuracy: each candidate's predicted step time times its statistical
efficiency, the steps it needs to reach a target over dense SGD's (1.0 for exact dense algorithms).
Efficiencies, first found wins: the ``efficiency`` option (``{label or name: ratio}``, e.g.
``{"gtopk(density=0.01)": 1.4, "local_sgd": 0.9}``), then ``efficiency_from`` (the ``results.json`` of a
benchmark convergence run: ratios of its rows' ``steps_to_target`` to dense's, its rows at this P if it
has any; see ``cost_model.efficiencies_from_results``), then ``cost_model.DEFAULT_EFFICIENCY`` (measured
on scikit-learn digits), else 1.0. ``candidates`` run from most to least exact; a candidate within
``tolerance`` of the best predicted time to accuracy is preferred over later ones, so a compute-bound job
stays on dense SGD. ``picked`` is the chosen :class:`~bagua_lite.Algorithm` (None during the probe),
``decision`` the inputs and predictions.

auto is not a proxy: at the decision it hands the model its pick (``DistributedModel.switch_algorithm``),
which from then on trains exactly as if the model had been built with it; ``model.configured_algorithm``
stays this object (``picked``, ``picked_label``, ``decision``), and a checkpoint resumes the same pick.
"""
import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from bagua_lite import comm, cost_model
from bagua_lite.algorithm import Algorithm, build, register, registered

log = logging.getLogger("bagua_lite")

_NOT_CANDIDATES = ("auto", "ddp", "ddp_fp16", "ddp_powersgd")


def _params(n):
    return f"{n / 1e6:.3g}M" if n >= 100_000 else f"{n}"


def _keeps_unequal_replicas(name, opts):
    """Whether a pick can start from replicas that differ (after local probe steps) as it would on its own:
    local SGD without warm-up (its first average comes at step H whatever the replicas) and without
    compression (which averages changes from an anchor that must be equal everywhere), and uncompressed
    decentralized SGD (its replicas differ by design and its exchanges send whatever they hold)."""
    if name == "local_sgd":
        return not opts.get("warmup_steps", 0) and opts.get("compression", "none") == "none"
    return name == "decentralized" and opts.get("compression", "none") == "none"  # compressed: copies from a common x_0


@register("auto")
class Auto(Algorithm):
    def __init__(self, candidates: list = cost_model.DEFAULT_AUTO_CANDIDATES, probe_steps: int = 3,
                 tolerance: float = 0.05, network: dict = None, machine: dict = None, compute_s: float = None,
                 backward_fraction: float = 0.66, efficiency: dict = None, efficiency_from: str = None):
        super().__init__()
        self.candidates = cost_model.normalize_candidates(candidates)
        for name, opts in self.candidates:
            if name in _NOT_CANDIDATES or name not in registered() or not cost_model.predictable(name):
                raise ValueError(f"auto: candidate {name!r} is not allowed: a candidate is a registered algorithm "
                                 f"that describes its traffic (Algorithm.traffic), such as "
                                 + ", ".join(n for n in cost_model.PREDICTABLE if n not in _NOT_CANDIDATES))
            build(name, **opts)  # validate the options now, before any traffic
        if not isinstance(probe_steps, int) or probe_steps < 0:
            raise ValueError(f"auto: probe_steps must be an int >= 0, got {probe_steps!r}")
        if not tolerance >= 0:
            raise ValueError(f"auto: tolerance must be >= 0, got {tolerance!r}")
        if network is not None:
            if not isinstance(network, dict) or not {"alpha", "beta"} <= set(network) <= {"alpha", "beta", "host_local"} \
                    or not all(isinstance(network[k], (int, float)) and network[k] >= 0 for k in ("alpha", "beta")):
                raise ValueError(f"auto: network must be {{alpha: seconds, beta: seconds per byte, host_local: bool "
                                 f"(optional)}} with alpha, beta >= 0, got {network!r}")
        if machine is not None:
            try:
                cost_model.Machine(**machine)
            except TypeError as e:
                raise ValueError(f"auto: machine must hold cost_model.Machine's fields: {e}") from None
        if compute_s is not None and not (isinstance(compute_s, (int, float)) and compute_s >= 0):
            raise ValueError(f"auto: compute_s must be a number >= 0 (seconds), got {compute_s!r}")
        if probe_steps == 0 and compute_s is None:
            raise ValueError("auto: probe_steps=0 needs compute_s (nothing is measured)")
        if not 0 <= backward_fraction <= 1:
            raise ValueError(f"auto: backward_fraction must be in [0, 1], got {backward_fraction!r}")
        self.efficiency_option = cost_model.check_efficiency(efficiency, self.candidates)
        if efficiency_from is not None:
            if not isinstance(efficiency_from, str):
                raise ValueError(f"auto: efficiency_from must be the path of a convergence results.json, "
                                 f"got {efficiency_from!r}")
            try:
                cost_model.efficiencies_from_results(efficiency_from)  # readable, and convergence results
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"auto: efficiency_from {efficiency_from!r}: {e}") from None
        self.efficiency_from = efficiency_from
        self.probe_steps = probe_steps
        self.tolerance = float(tolerance)
        self.network_option = network
        self.machine_option = machine
        self.compute_option = compute_s
        self.backward_fraction = float(backward_fraction)
        self.picked = None
        self.picked_label = None
        self.decision = None
        self._t0 = None
        self._probe_compute = []
        self._probe_waited = []

    # ---- set-up ------------------------------------------------------------------------------------------
    def init(self, model):
        if self.network_option is not None:
            self.network, self.network_source = cost_model.Network(**self.network_option), "given"
        else:
            # The same network measured earlier in this process (e.g. by the benchmark) is not probed again.
            self.network = cost_model.probe_network(model.process_group, reuse=True)
            self.network_source = "probed"
        if self.machine_option is not None:
            self.machine = cost_model.Machine(**self.machine_option)
        else:
            numel = max(b.numel for b in model.buckets)
            self.machine = cost_model.calibrate_machine(numel=min(1 << 22, max(1 << 16, numel)), repeats=3)
        if self.probe_steps == 0:
            self._decide(float(self.compute_option))  # hands the model its pick right away

    # ---- the probe steps: local SGD steps, nothing in the buckets, so the compute is measured clean -------
    def sync_gradients(self):
        return False

    @property
    def step_dependent_wire(self):
        """No bucket travels while probing. Every probe step ends in exactly one collective (its round's
        all_gather of the step counts, or the decision), so the ranks' probe collectives pair up by
        construction and every rank switches to the pick at the same step count."""
        return False

    def before_forward(self):
        if self.picked is None and self._t0 is None:
            self._t0 = (time.perf_counter(), self._waited())

    def after_step(self):
        if self.picked is not None:
            return
        if self._t0 is not None:
            t0, wait0 = self._t0
            self._probe_compute.append(max(0.0, time.perf_counter() - t0 - (self._waited() - wait0)))
            self._t0 = None
        if self.step >= self.probe_steps:
            measured = min(self._probe_compute) if self._probe_compute else 0.0
            self._decide(measured if self.compute_option is None else float(self.compute_option))
        else:
            self._probe_round(timed=self.step >= 2)

    def _waited(self):
        """Seconds this rank has waited on communication: the buckets, and the agreement after them (none
        while the probe steps are local; counted in case a no_sync block or a hook ran one)."""
        return self.model.timings["backward_wait_s"] + self.model.timings["agree_s"]

    def _probe_round(self, timed):
        """One synchronous round after a local probe step: an all_gather of the step counts (through
        ``run_collective``: a peer's failure raises within a second). Its wait is what a round costs
        beyond the network: on shared cores, mostly the peers' scheduling. Not kept after the first step:
        that round absorbs how far apart the ranks started (lazy initialisation in the first step took
        0.35-0.45 s on each of 4 ranks here, and its 15-55 ms of spread showed up as the round's cost)."""
        model = self.model
        if model.world_size == 1:
            return
        t0 = time.perf_counter()
        model.run_collective("auto probe round", lambda: model.check_in_step("auto was probing (nothing was "
                                                                             "exchanged)"))
        if timed:
            self._probe_waited.append(time.perf_counter() - t0)

    # ---- the decision ----------------------------------------------------------------------------------------
    def _workload(self, compute_s):
        numels = [b.numel for b in self.model.buckets]
        return cost_model.Workload(numel=sum(numels), elem_bytes=self.model.buckets[0].flat.element_size(),
                                   compute_s=compute_s, backward_fraction=self.backward_fraction,
                                   n_buckets=len(numels), bucket_numels=numels)

    def _round_s(self):
        """The fixed cost of one synchronous round beyond its data's transfer: the wait of a probe round,
        averaged over the timed ones. A probe round is what each of our synchronous rounds adds to its data
        collective (the agreement after the buckets, local SGD's step check at an average: one small
        collective), and its wait is that collective's latency plus, on shared cores, waiting for the
        peers to be scheduled (3-8 ms at P = 4 on 2 cores, where the network probe's alpha reads 1-2 ms:
        the wait minus the cost model's time for the message was 0 in 3 of 4 runs, and decentralized SGD
        then looked free and was picked at 8 ms/step against local SGD's 1). None if nothing was measured
        (fewer than 3 probe steps, or P = 1)."""
        if not self._probe_waited:
            return None
        return sum(self._probe_waited) / len(self._probe_waited)

    def _decide(self, compute_s):
        model = self.model
        m = self.machine
        round_s = self._round_s()
        if round_s is not None and self.machine_option is None:  # given machine figures are kept as given
            m = dataclasses.replace(m, round_s=round_s)
        fields = [f.name for f in dataclasses.fields(cost_model.Machine)]
        inputs = torch.tensor([self.step, -self.step, compute_s] + [getattr(m, f) for f in fields], dtype=torch.float64)
        if model.world_size > 1:  # the slowest rank sets the pace; and every rank decides on equal inputs
            model.run_collective("auto decision", lambda: dist.all_reduce(inputs, op=dist.ReduceOp.MAX,
                                                                          group=model.process_group))
        hi, lo = int(inputs[0]), -int(inputs[1])
        if hi != lo:
            raise RuntimeError(f"bagua_lite: ranks are out of step: auto's decision came at different optimizer "
                               f"step counts (from {lo} to {hi}; this is rank {model.rank}, at step {self.step}). "
                               f"Every rank must call optimizer.step() the same number of times")
        compute_s = float(inputs[2])
        machine = cost_model.Machine(**{f: float(v) for f, v in zip(fields, inputs[3:].tolist())})
        numels = [b.numel for b in model.buckets]
        work = self._workload(compute_s)
        efficiency = self._efficiency(model.world_size)
        i, preds = cost_model.choose(self.candidates, model.world_size, work, self.network, machine, self.tolerance,
                                     efficiency)
        name, opts = self.candidates[i]
        if self.probe_steps > 0 and model.world_size > 1 and not _keeps_unequal_replicas(name, opts):
            model.run_collective("auto replica average", self._average_replicas)
        self.picked = build(name, **opts)
        self.picked_label = cost_model.label(name, opts)
        self.decision = {"picked": i, "candidates": [[n, o] for n, o in self.candidates],
                         "predictions": preds, "efficiency": efficiency, "compute_s": compute_s, "machine": machine.__dict__,
                         "network": self.network.__dict__, "network_source": self.network_source,
                         "world_size": model.world_size, "bucket_numels": numels, "step": self.step}
        self.decision["line"] = self._line(i, preds, work, machine)
        if model.rank == 0:
            log.info(self.decision["line"])
            print(self.decision["line"], flush=True)
        model.switch_algorithm(self.picked)

    def _average_replicas(self):
        """After local probe steps: every rank's parameters and optimizer state become their average over
        the ranks (one allreduce per dtype), so a synchronous pick starts from identical replicas. The
        optimizer's floating-point state of these parameters (SGD's momentum, Adam's moments; a step
        counter is equal everywhere and stays so)."""
        opt = self.model.optimizer
        tensors = [p.data for p in self.model.params]
        for p in self.model.params:
            tensors += [v for v in opt.state.get(p, {}).values()
                        if isinstance(v, torch.Tensor) and v.is_floating_point()]
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch._utils._flatten_dense_tensors(group)
                comm.allreduce(flat, "avg", group=self.model.process_group)
                for t, avg in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    t.copy_(avg)

    def _efficiency(self, P):
        """The efficiencies in effect: the results file's (its rows at P if any), under the option's."""
        table = {}
        if self.efficiency_from is not None:
            try:
                table = cost_model.efficiencies_from_results(self.efficiency_from, world_size=P)
            except ValueError:
                table = cost_model.efficiencies_from_results(self.efficiency_from)
        table.update(self.efficiency_option)
        return table

    def _line(self, i, preds, work, machine):
        labels = [cost_model.label(n, o) for n, o in self.candidates]
        best = min(range(len(preds)), key=lambda j: preds[j]["weighted_s"])

        def terms(p):
            return (f"{p['step_s']:.3g} s/step x efficiency {p['efficiency']:.3g} ({p['efficiency_source']}) "
                    f"= {p['weighted_s']:.3g}")

        others = "; ".join(f"{labels[j]} {terms(preds[j])}" for j in range(len(preds)) if j != i)
        why = ""
        if best != i:
            why = (f"; within {self.tolerance:.0%} of the best, {labels[best]} "
                   f"{preds[best]['weighted_s']:.3g}, and listed earlier")
        probes = ""
        if self._probe_compute:
            probes = " (this rank's probe steps: " + ", ".join(f"{c:.3g}" for c in self._probe_compute) + " s)"
        net = self.network
        gbit = f"{8 / net.beta / 1e9:.3g} Gbit/s" if net.beta > 0 else "inf Gbit/s"
        return (f"bagua_lite auto: picked {labels[i]}: predicted {terms(preds[i])}, ranked by time to accuracy "
                f"(s/step x steps to target relative to dense SGD)" + (f"; vs {others}" if others else "") + why
                + f" (alpha={net.alpha:.3g} s, beta={net.beta:.3g} s/B = {gbit} {self.network_source}, "
                  f"{_params(work.numel)} params, compute {work.compute_s:.3g} s{probes}, "
                  f"round {machine.round_s:.3g} s, P={self.model.world_size})")

    # ---- state -------------------------------------------------------------------------------------------------
    def state_dict(self):
        """The step and the decision; the pick's own state is saved by the model beside it."""
        state = {"step": self.step, "picked": None}
        if self.picked is not None:
            state["picked"] = list(self.candidates[self.decision["picked"]])
            state["decision"] = self.decision
        return state

    def load_state_dict(self, state):
        self.step = int(state["step"])
        if state.get("picked") is not None:
            name, opts = state["picked"]
            self.picked = build(name, **dict(opts))
            self.picked_label = cost_model.label(name, opts)
            self.decision = state.get("decision")
            self.model.switch_algorithm(self.picked)
