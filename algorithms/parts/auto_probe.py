"""What ``auto`` measures before it decides: the network, the machine, and its probe steps.

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

Probing with local steps costs a pick that communicates every step one average of the weights and the
optimizer's state, about what the 2 dense steps cost that the probe used to take (the probe is now 3 steps,
with 2 small collectives and the decision's); it costs local SGD only those 3 small collectives (on digits
at P = 4 the dense probe steps and their rounds made auto's first 4 steps 2-3x local SGD's, and changed
its trajectory).
"""
import time

from bagua_lite import cost_model


def check_given(network, machine):
    """The ``network`` and ``machine`` options, which replace the measurements, if given."""
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


def network_and_machine(model, network_option, machine_option):
    """(network, "given" or "probed", machine): the options' if given, else measured (collective)."""
    if network_option is not None:
        network, source = cost_model.Network(**network_option), "given"
    else:
        # The same network measured earlier in this process (e.g. by the benchmark) is not probed again.
        network, source = cost_model.probe_network(model.process_group, reuse=True,
                                                           device=model.params[0].device), "probed"
    if machine_option is not None:
        machine = cost_model.Machine(**machine_option)
    else:
        numel = max(b.numel for b in model.buckets)
        machine = cost_model.calibrate_machine(numel=min(1 << 22, max(1 << 16, numel)), repeats=3)
    return network, source, machine


class Probe:
    """The probe steps' measurements: ``compute`` (seconds per step, this rank's) and the rounds' waits."""

    def __init__(self, model):
        self.model, self.compute, self.waited, self._t0 = model, [], [], None

    def start_step(self):
        if self._t0 is None:
            self._t0 = (time.perf_counter(), self._waited())

    def end_step(self):
        if self._t0 is not None:
            t0, wait0 = self._t0
            self.compute.append(max(0.0, time.perf_counter() - t0 - (self._waited() - wait0)))
            self._t0 = None

    def compute_s(self) -> float:
        """The fastest probe step's compute (0 if none was measured)."""
        return min(self.compute) if self.compute else 0.0

    def _waited(self):
        """Seconds this rank has waited on communication: the buckets, and the agreement after them (none
        while the probe steps are local; counted in case a no_sync block or a hook ran one)."""
        return self.model.timings["backward_wait_s"] + self.model.timings["agree_s"]

    def round(self, timed):
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
            self.waited.append(time.perf_counter() - t0)

    def round_s(self):
        """The fixed cost of one synchronous round beyond its data's transfer: the wait of a probe round,
        averaged over the timed ones. A probe round is what each of our synchronous rounds adds to its data
        collective (the agreement after the buckets, local SGD's step check at an average: one small
        collective), and its wait is that collective's latency plus, on shared cores, waiting for the
        peers to be scheduled (3-8 ms at P = 4 on 2 cores, where the network probe's alpha reads 1-2 ms:
        the wait minus the cost model's time for the message was 0 in 3 of 4 runs, and decentralized SGD
        then looked free and was picked at 8 ms/step against local SGD's 1). None if nothing was measured
        (fewer than 3 probe steps, or P = 1)."""
        if not self.waited:
            return None
        return sum(self.waited) / len(self.waited)
