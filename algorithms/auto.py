"""Auto: run the relaxation that the cost model predicts reaches the accuracy first for this model, network and P.

    set-up:                 measure the network and the machine             (``parts.auto_probe``)
    steps 1..probe_steps:   local SGD steps, nothing in the buckets: their compute, and the fixed cost
                            of a synchronous round between them, are measured clean  (``parts.auto_probe``)
    after the last probe:   agree on the inputs, pick by predicted time to accuracy, average the
                            replicas if the pick needs them equal, log one line  (``parts.auto_decision``)
    from then on:           the model runs the pick (auto hands it over); its step count is the
                            training's (the probe steps count as its first steps), so its schedule keeps
                            the phase it has on its own: local SGD averages after steps H, 2H, ... (H its
                            period), and with local SGD picked the whole run is local SGD's own
                            trajectory, bit for bit (tested), at the cost of the probe's collectives

Ranked by each candidate's predicted step time times its statistical efficiency (the steps it needs to
reach a target over dense SGD's: the ``efficiency`` option, then ``efficiency_from``, a benchmark
convergence run's results, then the built-in figures); ``candidates`` run from most to least exact, and
one within ``tolerance`` of the best is preferred over later ones. ``picked`` is the chosen
:class:`~bagua_lite.Algorithm` (None during the probe), ``decision`` the inputs and predictions.

auto is not a proxy: at the decision it hands the model its pick (``DistributedModel.switch_algorithm``),
which from then on trains exactly as if the model had been built with it; ``model.configured_algorithm``
stays this object (``picked``, ``picked_label``, ``decision``), and a checkpoint resumes the same pick.
"""
import dataclasses
import logging

from bagua_lite import cost_model
from bagua_lite._options import int_at_least, number_at_least, within
from bagua_lite.algorithm import Algorithm, build, register
from bagua_lite.elastic import MembershipError

from .parts import auto_decision as decide
from .parts.auto_probe import Probe, check_given, network_and_machine

log = logging.getLogger("bagua_lite")

#: auto's default candidates, most exact first (ties within auto's tolerance go to the earlier one)
DEFAULT_CANDIDATES = (
    {"name": "gradient_allreduce"},
    {"name": "gradient_allreduce", "options": {"compression": "fp16"}},
    {"name": "gtopk", "options": {"density": 0.001}},
    {"name": "topk", "options": {"density": 0.001}},
    {"name": "local_sgd"},
)


@register("auto")
class Auto(Algorithm):
    def __init__(self, candidates: list = DEFAULT_CANDIDATES, probe_steps: int = 3,
                 tolerance: float = 0.05, network: dict = None, machine: dict = None, compute_s: float = None,
                 backward_fraction: float = 0.66, efficiency: dict = None, efficiency_from: str = None):
        super().__init__()
        self.candidates = decide.check_candidates(candidates)
        int_at_least(self.name, "probe_steps", probe_steps, 0)
        number_at_least(self.name, "tolerance", tolerance, 0)
        check_given(network, machine)
        if compute_s is not None:
            number_at_least(self.name, "compute_s", compute_s, 0, " (seconds)")
        if probe_steps == 0 and compute_s is None:
            raise ValueError("auto: probe_steps=0 needs compute_s (nothing is measured)")
        within(self.name, "backward_fraction", backward_fraction, "[0, 1]")
        self.efficiency_option = cost_model.check_efficiency(efficiency, self.candidates)
        self.efficiency_from = decide.check_efficiency_from(efficiency_from)
        self.probe_steps = probe_steps
        self.tolerance = float(tolerance)
        self.network_option = network
        self.machine_option = machine
        self.compute_option = compute_s
        self.backward_fraction = float(backward_fraction)
        self.picked = None
        self.picked_label = None
        self.decision = None

    # ---- fault tolerance (DistributedModel(..., fault_tolerant=True)) ---------------------------------------
    @property
    def supports_membership_change(self):
        """When every candidate does: once it picked, the pick is the model's algorithm and heals itself as
        it would on its own. A worker lost during the probe ends the run (:meth:`heal`); workers waiting
        to join wait for the pick (``admits_joiners``), then get it from rank 0 with the state."""
        return all(getattr(build(name, **opts), "supports_membership_change", False) for name, opts in self.candidates)

    #: while probing: a lost worker is met before a local step or in a probe round, and ends in heal()
    heals_itself = True
    #: while probing (the pick admits them once it runs)
    admits_joiners = False

    @classmethod
    def predicted_as(cls, options, P, work, net, machine):
        """What :func:`~bagua_lite.cost_model.choose` picks from the options' ``candidates`` (with their
        ``network`` override and ``efficiency``, as :meth:`init` does), predicted under ``net``."""
        cands = cost_model.normalize_candidates(options.get("candidates", DEFAULT_CANDIDATES))
        pick_net = cost_model.Network(**options["network"]) if options.get("network") else net
        i, picks = cost_model.choose(cands, P, work, pick_net, machine, tolerance=options.get("tolerance", 0.05),
                                     efficiency=cost_model.check_efficiency(options.get("efficiency"), cands))
        name, opts = cands[i]
        return name, opts, {"picked": cost_model.label(name, opts), "efficiency": picks[i]["efficiency"]}

    def heal(self):
        raise MembershipError(f"auto: a worker was lost during its probe (its first {self.probe_steps} steps, at "
                              f"step {self.step}), before it picked an algorithm: restart the job, or name the "
                              f"algorithm in the config")

    # ---- set-up ------------------------------------------------------------------------------------------
    def init(self, model):
        if model.membership is not None and model.membership.joining:  # a joiner: rank 0's pick, not a probe
            import torch.distributed as dist
            box = [None]
            dist.broadcast_object_list(box, group_src=0, group=model.control_group)  # as the members send it (DistributedModel's admission)
            self.load_state_dict(box[0])  # hands the model the pick, set up as the members' regroup() did
            return
        self.probe = Probe(model)
        self.network, self.network_source, self.machine = network_and_machine(model, self.network_option,
                                                                              self.machine_option)
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
        if self.picked is None:
            self.probe.start_step()

    def after_step(self):
        if self.picked is not None:
            return
        self.probe.end_step()
        if self.step >= self.probe_steps:
            self._decide(self.probe.compute_s() if self.compute_option is None else float(self.compute_option))
        else:
            self.probe.round(timed=self.step >= 2)

    # ---- the decision ----------------------------------------------------------------------------------------
    def _decide(self, compute_s):
        model, m, round_s = self.model, self.machine, self.probe.round_s()
        if round_s is not None and self.machine_option is None:  # given machine figures are kept as given
            m = dataclasses.replace(m, round_s=round_s)
        compute_s, machine = decide.agree(model, self.step, compute_s, m)
        work = decide.workload(model, compute_s, self.backward_fraction)
        efficiency = self._efficiency(model.world_size)
        i, preds = cost_model.choose(self.candidates, model.world_size, work, self.network, machine, self.tolerance,
                                     efficiency)
        name, opts = self.candidates[i]
        if self.probe_steps > 0 and model.world_size > 1 and not decide.keeps_unequal_replicas(name, opts):
            model.run_collective("auto replica average", lambda: decide.average_replicas(model))
        self.picked = build(name, **opts)
        self.picked_label = cost_model.label(name, opts)
        self.decision = {"picked": i, "candidates": [[n, o] for n, o in self.candidates], "predictions": preds,
                         "efficiency": efficiency, "compute_s": compute_s, "machine": machine.__dict__,
                         "network": self.network.__dict__, "network_source": self.network_source,
                         "world_size": model.world_size, "bucket_numels": [b.numel for b in model.buckets],
                         "step": self.step}
        self.decision["line"] = decide.line(self.candidates, i, preds, self.tolerance, work, machine, self.network,
                                            self.network_source, self.probe.compute, model.world_size)
        if model.rank == 0:
            log.info(self.decision["line"])
            print(self.decision["line"], flush=True)
        model.switch_algorithm(self.picked)

    def _efficiency(self, P):
        """The efficiencies in effect: the results file's (its rows at P if any), under the option's."""
        return decide.efficiencies(self.efficiency_option, self.efficiency_from, P)

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
