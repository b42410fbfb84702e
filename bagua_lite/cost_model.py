"""The alpha-beta cost model: what one training step costs under each algorithm, and at which P it pays.

A message of ``m`` bytes costs ``alpha + m * beta`` (Hockney; BAGUA and gTop-k S-SGD use the same
model). Each rank has one full-duplex link: it can send and receive at once, but two messages it sends
at the same time share its bandwidth (the benchmark's emulated networks rate-limit each rank's
interface, which is exactly this). Notation, per bucket of ``n`` elements of ``e`` bytes
(``m = n * e``), on ``P`` ranks:

    ring(m)   = floor(2 (P-1) m / P)   bytes a rank sends in a ring allreduce (what comm counts)
    T_ring(m) = 2 (P-1) alpha + ring(m) beta
    k         = max(1, min(n, round(density * n)))          (as ErrorFeedbackSparsifier.k_for)
    wire(c)   = 2c (fp16, bf16) | 8 + c (minmax_uint8: float32 min and max, then c bytes)
                | 4 + ceil(c/8) (sign: float32 mean |x|, then a bit per element)
                | a user's compressor: its wire_bytes(c), padded to 8 bytes (pad(x) = 8 ceil(x/8))
                  wherever its buffers are (the Python path of the compressed allreduce)
    codec     = one compress + decompress round trip per element: Machine.fp16_s_per_elem,
                bf16_s_per_elem, quantize_s_per_elem (minmax_uint8 and users'), sign_s_per_elem
    CA(n)     = the compressed allreduce of n elements (gradient_allreduce's, below): its bytes,
                2 (P-1) alpha + bytes beta, and local n codec (3 + 1/P)/2; with a residual (error
                feedback) + n (codec/2 + 2 add)
    c_i       = n // P + (i < n % P)                         (chunk i of a compressed allreduce)
    P'        = the largest power of two <= P,   L = log2 P'

The model is four modules, gathered here: :mod:`~bagua_lite.cost_network` (networks and machines, and
measuring them), :mod:`~bagua_lite.cost_traffic` (the message and work formulas, :class:`Traffic`),
:mod:`~bagua_lite.cost_time` (from an algorithm to its traffic and the time of a step) and
:mod:`~bagua_lite.cost_choice` (efficiencies from convergence results, auto's choice, projections).

What travels is each algorithm's own description: its ``traffic`` classmethod returns a :class:`Traffic`
(message triples built from :func:`ring`, :func:`compressed_allreduce`, :func:`weight_average`, and local
work from :class:`Machine`), and this module times it (the overlap, shared cores, rounds: below). A user's
algorithm that describes its traffic is predicted and can be one of auto's candidates. What the built-ins
and the DDP baselines describe, per step (``bytes_per_rank`` = what ``bagua_lite.comm.bytes_sent()`` counts
on the busiest rank, summed over buckets; the latency term counts sequential messages):

=====================  ==========================================================================
``ddp``                torch DDP, ring allreduce per bucket: ring(m) bytes, T_ring(m); local: one
                       divide (n * add). Overlapped with backward bucket by bucket (see below).
``ddp_fp16``           fp16_compress_hook: ring(2n) bytes, T_ring(2n); local: cast there and back
                       (n * fp16) plus the divide. Overlapped.
``ddp_powersgd``       powerSGD_hook, rank r (option ``rank``, as the benchmark passes it, or
                       ``matrix_approximation_rank``), steady state (after start_powerSGD_iter).
                       Matrices from option ``shapes`` ([[rows, cols], ...]); without it, one
                       square matrix of n elements: rows = cols = sqrt(n). Two allreduces, of the
                       P-matrices (sum rows * r) and the Q-matrices (sum cols * r):
                       bytes ring(4 r sum rows) + ring(4 r sum cols), time 2 T_ring(...) terms;
                       plus one dense allreduce of whatever is left uncompressed (``uncompressed``
                       option, elements; default 0). Local: three skinny matmuls (M Q, M^T P,
                       P Q^T: 2 n r flops each) at max(flop rate, one pass over M), and four passes
                       for error feedback. One bucket (the benchmark runs it so): no overlap.
``gradient_allreduce`` compression none: ring(m), T_ring(m); local: the divide. fp16: as ddp_fp16 (a ring
                       allreduce of the half-precision bucket, pre-scaled by 1/P: ring(2n), T_ring(2n)).
                       Any other compressor (csrc/collectives/compressed_allreduce.cpp): all-to-all
                       of compressed chunks, rank i sends sum_{j != i} wire(c_j); then allgather
                       of its recompressed chunk padded to wire(c_0): (P-1) wire(c_0). Busiest rank:
                       the one with the smallest chunk (rank P-1). Time: (P-1) alpha for the
                       all-to-all (the P-1 sends serialise on the sender's link) + (P-1) alpha for
                       the ring allgather + bytes * beta. Local: compress n (1 + 1/P) and
                       decompress 2n elements: (3 + 1/P)/2 codec round trips per element; sign
                       (error feedback) adds its residual: + n (codec/2 + 2 add). This is CA(n).
                       ``hierarchical``: treated as dense (flat ring) — a model gap, stated here.
``topk``               TopKAllReduce (csrc/collectives/sparse_allreduce.cpp): k is the same on every
                       rank, so one allgather of [k, dtype as 2 int64][k values][k int32] (no size
                       exchange first): (P-1) (16 + k (e + 4)) bytes, (P-1) alpha. Local: topk
                       select (n * topk; n * topk_bounded where the selection has block maxima,
                       density <= 1/256 and not layerwise) + error-feedback add and zero of the dense output
                       (2 n * add) + scatter of the P k pre-divided pairs (P k * add).
``gtopk``              recursive doubling (csrc/collectives/gtopk_allreduce.cpp), message k (e + 4):
                       L swaps (send and receive at once: alpha + k (e + 4) beta each); if P != P',
                       one fold before and one unfold after, sequential: + 2 (alpha + k (e + 4) beta).
                       Busiest rank: rank 0, L + [P != P'] messages. ``exact``: + T_ring(k e) and
                       ring(k e) bytes. Local: topk + 2 n * add as for topk, plus a merge of 2k
                       pairs per message (2k * merge each) and the scatter of k pairs.
``powersgd``           ours (algorithms/powersgd.py), per bucket on the engine, steady state (after
                       ``warmup_steps``; ``warmup_step_s`` = gradient_allreduce's step). A bucket's
                       matrices (rows_j x cols_j, compressed when rows cols >= min_compression_rate
                       (rows + cols) r) and its dense rest d: allreduce of the P's, then of
                       [Q's | dense]: ring(e r sum rows) + ring(e (r sum cols + d)) bytes, one
                       T_ring per allreduce made. Shapes from the cost-model-only option
                       ``bucket_shapes`` (per bucket, its parameters' shapes); without it one
                       matrix per bucket, rows = round(sqrt n) as ddp_powersgd, cols = n // rows,
                       the rest dense. Local per matrix of N elements: N add (error feedback) +
                       4 max(2 N r flops, N add) (M Q, M^T P, M - P Q^T, P Q^T) + 2 rows r^2
                       flops (QR); dense: 3 d + r sum cols passes. Overlapped like the buckets.
``qadam``              steady state (after ``warmup_steps``; ``warmup_step_s`` = gradient_allreduce's
                       step): each bucket's momentum through CA(n) with ``compression`` (default
                       fp16, as algorithms/qadam.py) and a residual: bytes and time exactly
                       gradient_allreduce's with that compression plus the residual's work, on the
                       engine (overlapped); plus 3 n add for the momentum (gradient hook) and the
                       update (step pre-hook) on the training thread, never hidden.
``decentralized``      a weight exchange every ``communication_interval`` steps (amortised: divided
                       by it), on the flat weights (m = all parameters): started when forward starts,
                       applied after the optimizer step. Unit u = m, or with ``compression``
                       pad(wire(n)) (decentralized pads its wire buffers). ring: P >= 3 sends u to
                       both neighbours at once on one link: alpha + 2 u beta, 2u bytes; P = 2, and
                       ring_one_way and shift_one always, one peer: alpha + u beta, u bytes (odd P
                       under shift_one: one rank sits each exchange out; the model reports the busy
                       ones). all: exact T_ring(m), ring(m); compressed: a ring allgather,
                       (P-1) alpha + (P-1) u beta, (P-1) u bytes. Local, exact (training thread,
                       never hidden): gather, sum of the k peers' (k-1), subtract, apply: k + 2
                       passes (all: 4). Compressed, with d = peers received from (ring 2, or 1 at
                       P = 2; ring_one_way 1; all P-1): the exchange's thread does 2 add passes +
                       (d + 2)/2 codec round trips (compress + d + 1 decompressions), the training
                       thread 1 (the apply), and the wire starts after the first chunk (2^20
                       elements: 1 add + half a codec round trip each) is packed. The transfer
                       overlaps with the whole step: exposed = max(0, first + T - busy), busy =
                       compute_s (+ the thread's work when Machine.cores_per_rank < 2: it is taken
                       from the compute); with cores_per_rank < 2 each message's latency is protocol
                       work on the computing cores, one alpha per peer sent to (ring: 2), never hidden,
                       and on a host_local network the bytes are copies on those cores too:
                       exposed = peers alpha (+ the rest of T, hidden as above; host_local: all of it).
                       (Measured at P = 4 on 2 cores, 17k parameters: the ring's exchange added 1.6-2 ms
                       a step, where one hidden alpha predicted none.)
``low_precision_decentralized``
                       decentralized with compression minmax_uint8 (and peer_selection ring) by
                       default; compression none is an error, as in the algorithm.
``local_sgd``          steady state: T_ring(m) of the weights every ``period`` steps, after the
                       step (not overlapped): (T_ring(m) + 3 n * add) / period per step, ring(m) /
                       period bytes. With ``compression``: CA(n) of the change since the last
                       average, with a residual, instead of T_ring(m), and 5 passes (snapshot,
                       x - anchor, + anchor, anchor copy, apply) plus CA's instead of 3. Warm-up steps
                       cost what gradient_allreduce costs; that figure is returned as
                       ``warmup_step_s``.
``async_model_average`` steady state: a background round every I = sync_interval_ms / 1000 s plus
                       its own length: T_a = the average's transfer (T_ring(m), or CA(n) with
                       ``compression``) + 2 (P-1) alpha (the go-on flag), local L_a = 4 passes
                       (snapshot, copy, apply as x + avg - snapshot: 2), compressed 6 + CA's;
                       period = I + T_a + L_a. The training thread never waits: with
                       Machine.cores_per_rank < 2 the round's CPU, c = L_a (+ T_a on a host_local
                       network), is stolen from it, so step = compute_s / (1 - c / period);
                       otherwise step = compute_s. Bytes per step: the average's bytes (ring(m) or
                       CA's) times step / period (``rounds_per_step``; ``bytes_per_round`` too;
                       ``bytes_per_rank()`` refuses it: it needs the step time). ``warmup_step_s``:
                       gradient_allreduce's step.
``auto``               whatever :func:`choose` picks from the options' ``candidates`` (with their
                       ``network`` override and ``efficiency`` if any, as the algorithm does);
                       predicted under ``net``.
=====================  ==========================================================================

Options not given take the registered algorithm's defaults (read from its signature); an
unknown algorithm, compression or peer_selection, and combinations the algorithms refuse (compression
with shift_one, low_precision_decentralized or qadam without compression), raise ValueError. On P = 1
nothing is sent; the after-step averaging algorithms are taken as doing no local work either.

Overlap (the engine, or DDP's reducer): backward lasts ``Tb = backward_fraction * compute_s``; bucket i
is ready when the share of parameters up to and including it has its gradients,
``ready_i = Tb * (n_0 + ... + n_i) / n``; one worker runs buckets in order, each taking
``e_i = local_i + comm_i``: ``finish_i = max(ready_i, finish_{i-1}) + e_i``. What sticks out after
backward, ``exposed = max(0, finish_last - Tb)``, is paid; the rest is ``hidden_s``. So
``step_s = compute_s + compression_s + comm_s - hidden_s``. That needs a core for the engine thread
next to autograd's: with ``Machine.cores_per_rank < 2`` (ranks share cores, as 4 ranks on 2 cores do)
local work (compression, selection, error feedback) cannot hide; only waiting on the network can, and the
pipeline runs over the communication times alone: ``exposed = compression_s + pipeline(comm_i)``. On one
host with no rate limit (``Network.host_local``: loopback) and shared cores the transfer is kernel copies
on those same cores, so nothing hides: ``exposed = compression_s + comm_s``.

Local costs come from :class:`Machine` (per element, measured by :func:`calibrate_machine`).
``Machine.round_s`` is the fixed cost of one of our synchronous rounds beyond the network's alpha: the
agreement all_gather after the buckets, the engine's hand-offs and, on shared cores, waiting for the
peers to be scheduled. Every bucketed algorithm of ours pays it each step (DDP's reducer does not: its
baselines leave it out), local SGD at each average (round_s / period) and decentralized at each exchange
(round_s / communication_interval); async averaging's rounds are off the training thread. It is 0 unless
measured: auto takes it from its probe, the mean wait of the small all_gather it runs between local probe
steps (what our rounds add to their data collective: the agreement, local SGD's step check). On loopback
it measured 0.6-0.8 ms with 2 processes on 2 cores and 5.5-10 ms with 4.

Time to accuracy: a cheap step is worth nothing if the model needs more of them. :func:`choose` ranks
candidates by ``step_s * efficiency``, where ``efficiency`` is the candidate's steps to a target accuracy
over dense SGD's (1.0 for exact dense algorithms; < 1 reaches it in fewer steps). That product is the
predicted time to accuracy in units of dense SGD's steps to target. Efficiencies come from the caller
(a mapping label-or-name -> ratio, e.g. :func:`efficiencies_from_results` of the benchmark's convergence
``results.json``), else from ``DEFAULT_EFFICIENCY`` (measured on scikit-learn digits: the results shipped in
``bagua_lite/digits_convergence.json``), else 1.0.

Example::

    net = Network(alpha=5e-5, beta=8e-9)                    # 1 Gbit/s
    mach = calibrate_machine()
    work = Workload(numel=25_000_000, compute_s=0.28, n_buckets=4)
    predict("gtopk", {"density": 0.001}, 4, work, net, mach)["step_s"]
    project([("gtopk", {"density": 0.001}), ("gradient_allreduce", {})], [16, 1024], work, net, mach)
"""

from .cost_choice import (DEFAULT_EFFICIENCY, DIGITS_RESULTS, check_efficiency, choose, efficiencies_from_results,
                          efficiency_of, label, normalize_candidates, project)
from .cost_network import HOST_LOCAL_MIN_BPS, Machine, Network, Workload, calibrate_machine, cores_per_rank, probe_network
from .cost_time import bytes_per_rank, option_defaults, predict, predictable, predictable_names, traffic_of
from .cost_traffic import (Traffic, aligned, codec_s, compressed_allreduce, compressed_allreduce_s, compressor_info,
                           dense_allreduce, k_of, per_bucket, pow2_core, ring, ring_bytes, side, weight_average,
                           weight_average_s, wire_bytes)

__all__ = ["Network", "Machine", "Workload", "probe_network", "calibrate_machine", "predict", "project", "choose",
           "bytes_per_rank", "label", "normalize_candidates", "efficiency_of", "check_efficiency",
           "efficiencies_from_results", "predictable", "predictable_names", "DEFAULT_EFFICIENCY", "Traffic",
           "traffic_of", "option_defaults", "HOST_LOCAL_MIN_BPS", "DIGITS_RESULTS", "cores_per_rank", "ring",
           "ring_bytes", "aligned", "codec_s", "compressed_allreduce", "compressed_allreduce_s", "compressor_info",
           "dense_allreduce", "k_of", "per_bucket", "pow2_core", "side", "weight_average", "weight_average_s",
           "wire_bytes"]
