"""Emulated slow networks on a single machine, for the benchmark.

Layout
------
``EmulatedNetwork(P, rate)`` builds, for ranks ``0..P-1``::

    netns <tag>ns<r>                     host network namespace
    +--------------------+               +--------------------------+
    | lo (up)            |               |                          |
    | <tag>n<r> 10.77.0.(r+1)/24 <==veth==> <tag>h<r> --- bridge <tag>b
    |   tbf rate R       |               |   tbf rate R             |
    +--------------------+               +--------------------------+

Every rank sits in its own network namespace, connected to one Linux bridge by a veth pair. Each link is
rate-limited in *both* directions with a token-bucket filter (``tc qdisc ... tbf``): the egress of the
namespace end limits what the rank sends, the egress of the bridge end limits what it receives. A flow
from rank a to rank b therefore crosses a's uplink and b's downlink, like a switch with full-duplex
ports of rate R. The bridge has no IP address, so the namespaces can only reach each other, and two
networks (two runs, or two instances) with the same addresses never see each other.

Nodes
-----
A namespace may hold several ranks: the benchmark's ``ranks_per_node`` (``runner.launch``) builds
``EmulatedNetwork(P / ranks_per_node, rate)`` and starts consecutive ranks in one namespace, a "node",
all with the node's interface and address. Ranks of one node reach each other at that address, which is
local to the namespace, so the kernel carries their traffic over the namespace's own ``lo``: not
rate-limited, as the links inside a real node are fast. Traffic between nodes crosses the veths, and the
ranks of a node share their node's link, as the GPUs of a node share its NIC. The self-test's
``--ranks-per-node 2`` times an allreduce inside one node against one across two (``measure_allreduce``).

With ``rate=None`` (the ``"loopback"`` network) nothing is created: ``command`` returns argv unchanged,
``address`` is 127.0.0.1 and ``interface`` is ``lo``. The benchmark can thus treat all networks alike.

Names
-----
``tag = prefix + str(pid)`` (plus a letter ``a``, ``b``, ... for the 2nd, 3rd... instance in the same
process), so concurrent runs never collide, and a leftover of a crashed run names the pid that made it:
``cleanup_stale(prefix)`` removes leftovers whose pid no longer exists. Interface names must fit in 15
characters (IFNAMSIZ - 1), which is checked at construction.

Token-bucket parameters
-----------------------
* ``burst`` (bucket size) = max(rate / HZ, 128 KiB), with HZ = 250. ``rate/HZ`` is the classic rule
  (the bucket must hold what the link sends in one timer tick, or the qdisc cannot keep the link busy
  between wake-ups; at 10gbit that is 5 MB). The floor keeps whole GSO/TSO super-packets (up to 64 KiB
  on veth) in one piece: tbf has to split packets larger than the bucket, which costs a lot of CPU.
* ``latency`` (how long a packet may wait in the queue, which sets the queue length) = 20 ms. Senders are
  local, so TCP small queues push back before the queue overflows; 20 ms is plenty to keep the link
  busy at every rate while keeping queueing delay bounded.

tbf counts whole Ethernet frames, so TCP goodput tops out at 1448/1514 = 95.6% of the rate (1500-byte
MTU with timestamps); the self-test shows 95-96% at 100mbit and 1gbit. At 10gbit the veth path is
CPU-bound on small machines (about 9 Gbit/s of Python-socket traffic on 2 cores), so that link is only
as fast as the CPUs allow.

Latency
-------
Not emulated. The kernel here has no ``sch_netem``, and a delay added in one framework's own sends
(a sleep per message) would not slow the DDP baselines' traffic, which would make the comparison
unfair, so the emulated links only limit the rate. The links' real latency (veth + bridge, some tens of
microseconds) is what the cost model's alpha measures; the projections take alpha as a parameter.

Self-check: ``python -m bagua_lite.bench.netem --selftest --rate 1gbit`` (as root) measures TCP throughput
between two namespaces and the time of a gloo allreduce inside the namespaces, against plain loopback.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

__all__ = ["EmulatedNetwork", "NetemError", "NETWORKS", "available", "parse_rate", "tbf_params",
           "cleanup_stale"]

#: Network names the benchmark configuration may use, mapped to the tbf rate (None: plain loopback).
NETWORKS = {"loopback": None, "10gbit": "10gbit", "1gbit": "1gbit", "100mbit": "100mbit"}


ASSUMED_HZ = 250  # timer frequency used to size the token bucket (see module docstring)
MIN_BURST_BYTES = 128 * 1024
TBF_LATENCY_MS = 20
IFNAMSIZ = 15  # longest interface name the kernel accepts
SUBNET = "10.77.0"

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


class NetemError(RuntimeError):
    """Setting up or using an emulated network failed. ``cmd`` and ``stderr`` name the failing command."""

    def __init__(self, msg: str, cmd: list[str] | None = None, stderr: str = ""):
        super().__init__(msg)
        self.cmd = cmd
        self.stderr = stderr


def parse_rate(s: str) -> int:
    """A tc-style rate such as ``"10gbit"``, ``"1gbit"``, ``"100mbit"``, ``"500kbit"`` → bits per second."""
    if not isinstance(s, str):
        raise ValueError(f"rate must be a string such as '1gbit', got {s!r}")
    m = _RATE_RE.match(s.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"invalid rate {s!r}: expected <number><unit> with unit one of "
                         f"{', '.join(_UNITS)} (e.g. '10gbit', '1gbit', '100mbit', '500kbit')")
    bps = float(m.group(1)) * _UNITS[m.group(2)]
    if bps < 8000:
        raise ValueError(f"invalid rate {s!r}: must be at least 8kbit")
    return int(round(bps))


def tbf_params(rate_bps: int) -> dict:
    """tbf arguments for a link of ``rate_bps``: rate, bucket size (burst) and queueing latency."""
    burst = max(rate_bps // 8 // ASSUMED_HZ, MIN_BURST_BYTES)
    return {"rate": f"{rate_bps}bit", "burst": burst, "latency": f"{TBF_LATENCY_MS}ms"}


def _run(cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetemError(f"command failed: {' '.join(cmd)}: {e}", cmd, str(e)) from e
    if check and p.returncode != 0:
        err = p.stderr.strip()
        raise NetemError(f"command failed (exit {p.returncode}): {' '.join(cmd)}\n{err}", cmd, err)
    return p


def _tbf_cmd(dev: str, rate_bps: int, netns: str | None = None) -> list[str]:
    p = tbf_params(rate_bps)
    where = ["-n", netns] if netns else []
    return ["tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", p["rate"], "burst", str(p["burst"]), "latency", p["latency"]]


# --------------------------------------------------------------------------------------------- names

def _check_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[a-z][a-z_]*", prefix or ""):
        raise ValueError(f"prefix must be lowercase letters/underscores (no digits), got {prefix!r}")


def _stale_re(prefix: str) -> re.Pattern:
    # tag = prefix + pid + optional instance letter; then b (bridge), h<r>/n<r> (veth ends), ns<r>.
    return re.compile(rf"^{re.escape(prefix)}(\d+)[a-z]?(?:b|h\d+|n\d+|ns\d+)$")


def _list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = "bl") -> list[str]:
    """Remove namespaces, veths and bridges named ``prefix<pid>...`` whose pid no longer exists.

    Leftovers of a run that was SIGKILLed (or crashed hard) are found by name; a live pid is never
    touched, so networks of runs in progress are safe. Returns the removed names."""
    _check_prefix(prefix)
    pat = _stale_re(prefix)
    removed = []
    links = _list_links()
    # Host veth ends first (deleting one end deletes its peer), then bridges, then namespaces.
    order = sorted(links, key=lambda n: 0 if re.search(r"h\d+$", n) else 1)
    for name in order:
        m = pat.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _run(["ip", "link", "del", name], check=False).returncode == 0:
                removed.append(name)
    for name in _list_netns():
        m = pat.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


# --------------------------------------------------------------------------------------------- network

_instance_counters: dict[str, itertools.count] = {}
_counter_lock = threading.Lock()


class EmulatedNetwork:
    """Context manager: P network namespaces on a bridge, each link rate-limited with tc tbf.

    ``rate`` is a tc rate (``"1gbit"``) or None for plain loopback (nothing is created).
    """

    def __init__(self, world_size: int, rate: str | None, prefix: str = "bl"):
        if not isinstance(world_size, int) or not 1 <= world_size <= 254:
            raise ValueError(f"world_size must be an int in 1..254, got {world_size!r}")
        _check_prefix(prefix)
        self.world_size = world_size
        self.rate = rate
        self.rate_bps = parse_rate(rate) if rate is not None else None
        self.prefix = prefix
        with _counter_lock:
            k = next(_instance_counters.setdefault(prefix, itertools.count()))
        suffix = "" if k == 0 else chr(ord("a") + (k - 1) % 26)
        self.tag = f"{prefix}{os.getpid()}{suffix}"
        self.bridge = f"{self.tag}b"
        last = world_size - 1
        longest = max(len(self.bridge), len(self._host_if(last)), len(f"{self.tag}n{last}"))
        if longest > IFNAMSIZ:
            raise ValueError(f"interface names for prefix {prefix!r} and {world_size} ranks would be {longest} "
                             f"characters (limit {IFNAMSIZ}); use a shorter prefix")
        self._created_links: list[str] = []
        self._created_netns: list[str] = []
        self._active = False
        self._prev_handlers: dict[int, object] = {}
        self._lock = threading.RLock()

    # -- naming --------------------------------------------------------------------------------------
    @property
    def emulated(self) -> bool:
        """True when namespaces are used (a rate was given); False for plain loopback."""
        return self.rate is not None

    def namespace(self, rank: int) -> str:
        self._check_rank(rank)
        return f"{self.tag}ns{rank}"

    def _host_if(self, rank: int) -> str:
        return f"{self.tag}h{rank}"

    def interface(self, rank: int) -> str:
        """The interface name inside rank's namespace (``GLOO_SOCKET_IFNAME``); ``lo`` for loopback."""
        self._check_rank(rank)
        return f"{self.tag}n{rank}" if self.emulated else "lo"

    def address(self, rank: int) -> str:
        """rank's IPv4 address: 10.77.0.(rank+1) in its namespace, 127.0.0.1 for loopback."""
        self._check_rank(rank)
        return f"{SUBNET}.{rank + 1}" if self.emulated else "127.0.0.1"

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """argv wrapped to run inside rank's namespace (unchanged for loopback)."""
        self._check_rank(rank)
        argv = list(argv)
        return ["ip", "netns", "exec", self.namespace(rank), *argv] if self.emulated else argv

    def env(self, rank: int) -> dict:
        """Convenience: what a worker of ``rank`` needs in its environment (the gloo interface)."""
        return {"GLOO_SOCKET_IFNAME": self.interface(rank)}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world_size {self.world_size}")

    def __repr__(self):
        return (f"EmulatedNetwork(world_size={self.world_size}, rate={self.rate!r}, "
                f"tag={self.tag!r}, active={self._active})")

    # -- lifecycle -----------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        with self._lock:
            if self._active:
                raise NetemError(f"{self!r} is already active")
            self._active = True
            atexit.register(self.cleanup)
            self._install_signal_handlers()
            if not self.emulated:
                return self
            try:
                self._create()
            except BaseException:
                self.cleanup()
                raise
            return self

    def __exit__(self, *exc):
        self.cleanup()
        return False

    def _do(self, cmd: list[str]) -> None:
        _run(cmd)

    def _create(self) -> None:
        br = self.bridge
        self._do(["ip", "link", "add", br, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
        self._created_links.append(br)
        self._do(["ip", "link", "set", br, "up"])
        for r in range(self.world_size):
            ns, host_if, ns_if = self.namespace(r), self._host_if(r), self.interface(r)
            self._do(["ip", "netns", "add", ns])
            self._created_netns.append(ns)
            self._do(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns])
            self._created_links.append(host_if)
            self._do(["ip", "link", "set", host_if, "master", br, "up"])
            self._do(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._do(["ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", ns_if])
            self._do(["ip", "-n", ns, "link", "set", ns_if, "up"])
            self._do(_tbf_cmd(ns_if, self.rate_bps, netns=ns))  # what the rank sends
            self._do(_tbf_cmd(host_if, self.rate_bps))          # what the rank receives

    def cleanup(self) -> None:
        """Remove everything this network created and restore signal handlers (idempotent)."""
        with self._lock:
            errors = []
            # Deleting the host end of a veth removes both ends, even if processes still live in the
            # namespace (deleting the namespace alone would keep it and its veth alive until they exit).
            for name in reversed(self._created_links):
                p = _run(["ip", "link", "del", name], check=False)
                if p.returncode != 0 and "Cannot find device" not in p.stderr:
                    errors.append(f"ip link del {name}: {p.stderr.strip()}")
            self._created_links.clear()
            for ns in reversed(self._created_netns):
                p = _run(["ip", "netns", "del", ns], check=False)
                if p.returncode != 0 and "No such file" not in p.stderr:
                    errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
            self._created_netns.clear()
            if self._active:
                self._active = False
                self._restore_signal_handlers()
                atexit.unregister(self.cleanup)
            if errors:
                warnings.warn("EmulatedNetwork cleanup: " + "; ".join(errors), RuntimeWarning, stacklevel=2)

    # -- signals -------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still applies
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            # Only undo our own handler: if someone installed another one meanwhile, leave theirs.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers.clear()

    def _on_signal(self, signum, frame):
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.cleanup()  # also restores the previous handlers
        if callable(prev):
            prev(signum, frame)  # e.g. Python's default SIGINT handler raises KeyboardInterrupt
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # die of the signal, as the process would have without us


# --------------------------------------------------------------------------------------------- availability

def available() -> tuple[bool, str]:
    """(True, "") if namespaces, veth, bridges and tbf really work here, else (False, reason).

    Tries the real thing: creates and deletes a throwaway namespace, bridge, veth pair and tbf qdisc."""
    if not sys.platform.startswith("linux"):
        return False, f"needs Linux (network namespaces), this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "needs root (creating network namespaces, veths and qdiscs requires CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"iproute2 not found ('{tool}' is not on PATH)"
    net = EmulatedNetwork(1, "1gbit", prefix="blprobe")
    try:
        net._active = True  # no signal handlers/atexit for this short probe; cleanup below
        net._create()
        _run(net.command(0, ["ip", "link", "show", "lo"]))
    except NetemError as e:
        return False, f"network emulation does not work here: {e}"
    finally:
        net.cleanup()
    return True, ""


# --------------------------------------------------------------------------------------------- self-test
# The helpers below run in child processes started with `ip netns exec`. Children load this file by
# path (not via the package) so that the throughput test does not import torch.

_CHILD_LAUNCHER = ("import importlib.util as u, sys; s = u.spec_from_file_location('_bagua_lite_netem', {path!r}); "
                   "m = u.module_from_spec(s); s.loader.exec_module(m); m._child_main(sys.argv[1:])")


def _child_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", _CHILD_LAUNCHER.format(path=os.path.abspath(__file__)), *args]


def _child_main(argv: list[str]) -> None:
    mode, rest = argv[0], argv[1:]
    if mode == "sink":
        _sink(rest[0], int(rest[1]))
    elif mode == "source":
        _source(rest[0], int(rest[1]), float(rest[2]))
    elif mode == "allreduce":
        _allreduce_worker(*rest)
    else:
        raise SystemExit(f"unknown child mode {mode!r}")


def _sink(host: str, port: int) -> None:
    """Accept one connection, read until EOF, print {"bytes", "seconds"} measured from the first byte."""
    srv = socket.create_server((host, port))
    print("listening", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    n = conn.recv_into(view)
    t0, total = time.perf_counter(), 0
    while True:
        k = conn.recv_into(view)
        if k == 0:
            break
        total += k
    dt = time.perf_counter() - t0
    conn.close()
    print(json.dumps({"bytes": total, "seconds": dt, "first": n}), flush=True)


def _source(host: str, port: int, seconds: float) -> None:
    """Send zeros to host:port for ``seconds``, then close."""
    deadline = time.monotonic() + 30
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    data = bytes(1 << 20)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    s.close()


def _allreduce_worker(rank: str, world_size: str, init: str, numel: str, iters: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    rank_i, ws = int(rank), int(world_size)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank_i, world_size=ws,
                            timeout=datetime.timedelta(seconds=300))
    x = torch.ones(int(numel))
    dist.all_reduce(x)  # warm-up: connections, buffers
    times = []
    for _ in range(int(iters)):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    ok = bool(x[0].item() == ws ** (int(iters) + 1))
    dist.destroy_process_group()
    print(json.dumps({"rank": rank_i, "times": times, "ok": ok}), flush=True)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            if p.returncode != 0:
                raise NetemError(f"child failed (exit {p.returncode}): {' '.join(p.args[:5])}...\n{err.strip()}",
                                 list(p.args), err)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def measure_throughput(net: EmulatedNetwork, seconds: float = 3.0, port: int = 5201) -> float:
    """TCP throughput (bit/s) from rank 0 to rank 1 of ``net``, with plain Python sockets."""
    host = net.address(1)
    if not net.emulated:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    sink = subprocess.Popen(net.command(1, _child_cmd("sink", host, str(port))), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = sink.stdout.readline()
    if line.strip() != "listening":
        sink.kill()
        raise NetemError(f"throughput sink did not start: {line!r} {sink.stderr.read()}")
    source = subprocess.Popen(net.command(0, _child_cmd("source", host, str(port), str(seconds))),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_sink, _ = _wait_all([sink, source], timeout=seconds + 60)
    r = json.loads(out_sink.strip().splitlines()[-1])
    return r["bytes"] * 8 / r["seconds"]


def measure_allreduce(net: EmulatedNetwork, numel: int = 25_000_000, iters: int = 3,
                      port: int = 29500, ranks_per_node: int = 1, nodes: int | None = None) -> dict:
    """Launch gloo workers in the namespaces and time allreduce of ``numel`` floats: ``ranks_per_node``
    consecutive ranks in each of the first ``nodes`` namespaces (default: all of them), so
    ``ranks_per_node=2, nodes=1`` times an allreduce that stays inside one node (its loopback), and
    ``nodes=2`` with one rank per node the same allreduce across the link."""
    nodes = net.world_size if nodes is None else nodes
    if not 1 <= nodes <= net.world_size or ranks_per_node < 1:
        raise ValueError(f"measure_allreduce: nodes must be in 1..{net.world_size} and ranks_per_node >= 1, got "
                         f"nodes={nodes}, ranks_per_node={ranks_per_node}")
    if not net.emulated:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    init = f"tcp://{net.address(0)}:{port}"
    world = nodes * ranks_per_node
    procs = []
    for r in range(world):
        node = r // ranks_per_node
        env = {**os.environ, **net.env(node), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            net.command(node, _child_cmd("allreduce", str(r), str(world), init, str(numel), str(iters))),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = _wait_all(procs, timeout=300)
    results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    # An allreduce finishes when its slowest rank does.
    per_iter = [max(r["times"][i] for r in results) for i in range(iters)]
    return {"mean_s": sum(per_iter) / iters, "min_s": min(per_iter), "ok": all(r["ok"] for r in results)}


def _selftest(rates: list[str], world_size: int, seconds: float, numel: int, iters: int,
              allreduce: bool, ranks_per_node: int = 1) -> int:
    ok, why = available()
    if not ok:
        print(f"network emulation unavailable: {why}")
        return 1
    stale = cleanup_stale("bl")
    if stale:
        print(f"removed leftovers of earlier runs: {', '.join(stale)}")
    print(f"TCP throughput, rank 0 -> rank 1, {seconds:g} s, plain Python sockets")
    for rate in [None, *rates]:
        with EmulatedNetwork(2, rate) as net:
            bps = measure_throughput(net, seconds)
        if rate is None:
            print(f"  {'loopback':>9}: {bps / 1e6:10.1f} Mbit/s")
        else:
            target = parse_rate(rate)
            print(f"  {rate:>9}: {bps / 1e6:10.1f} Mbit/s  (target {target / 1e6:g}, "
                  f"{100 * bps / target:.1f}%)")
    if allreduce:
        mb = numel * 4 / 1e6
        print(f"gloo allreduce of {numel} floats ({mb:g} MB), P={world_size}, {iters} timed iterations")
        for rate in [None, *rates]:
            with EmulatedNetwork(world_size, rate) as net:
                r = measure_allreduce(net, numel, iters)
            line = f"  {rate or 'loopback':>9}: {r['mean_s']:.3f} s/allreduce (min {r['min_s']:.3f})"
            if rate is not None:
                ideal = 2 * (world_size - 1) / world_size * numel * 4 * 8 / parse_rate(rate)
                line += f"  (bandwidth bound {ideal:.3f} s)"
            print(line + ("" if r["ok"] else "  WRONG RESULT"))
        if ranks_per_node > 1:
            print(f"nodes of {ranks_per_node} ranks: the same allreduce among {ranks_per_node} ranks inside one "
                  f"node (its loopback) and among {ranks_per_node} ranks one per node (across the link)")
            for rate in rates:
                with EmulatedNetwork(ranks_per_node, rate) as net:
                    inside = measure_allreduce(net, numel, iters, ranks_per_node=ranks_per_node, nodes=1)
                    across = measure_allreduce(net, numel, iters, ranks_per_node=1)
                print(f"  {rate:>9}: inside a node {inside['mean_s']:.3f} s, across nodes {across['mean_s']:.3f} s "
                      f"({across['mean_s'] / max(inside['mean_s'], 1e-9):.0f}x)"
                      + ("" if inside["ok"] and across["ok"] else "  WRONG RESULT"))
    leftovers = [n for n in _list_netns() + _list_links() if _stale_re("bl").match(n)]
    print("leftovers after cleanup:", leftovers or "none")
    return 0 if not leftovers else 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bagua_lite.bench.netem", description=__doc__.split("\n")[0])
    ap.add_argument("--selftest", action="store_true", help="measure throughput and allreduce time")
    ap.add_argument("--rate", action="append", help="tc rate(s) to test, repeatable or comma separated "
                                                    "(default 1gbit)")
    ap.add_argument("--world-size", type=int, default=4, help="ranks in the allreduce demo (default 4)")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each throughput test")
    ap.add_argument("--numel", type=int, default=25_000_000, help="floats per allreduce (default 25M)")
    ap.add_argument("--iters", type=int, default=3, help="timed allreduces per network")
    ap.add_argument("--no-allreduce", action="store_true", help="skip the gloo allreduce demo")
    ap.add_argument("--ranks-per-node", type=int, default=1, help="also time the allreduce among this many "
                    "ranks inside one node (one namespace) against as many ranks one per node (default 1: no)")
    ap.add_argument("--cleanup-stale", metavar="PREFIX", help="remove leftovers of dead runs and exit")
    ap.add_argument("--check", action="store_true", help="print whether emulation is available and exit")
    args = ap.parse_args(argv)
    if args.check:
        ok, why = available()
        print("available" if ok else f"unavailable: {why}")
        return 0 if ok else 1
    if args.cleanup_stale:
        print("\n".join(cleanup_stale(args.cleanup_stale)) or "nothing to remove")
        return 0
    if not args.selftest:
        ap.print_help()
        return 2
    rates = [r.strip() for spec in (args.rate or ["1gbit"]) for r in spec.split(",") if r.strip()]
    for r in rates:
        parse_rate(r)
    return _selftest(rates, args.world_size, args.seconds, args.numel, args.iters, not args.no_allreduce,
                     args.ranks_per_node)


if __name__ == "__main__":
    sys.exit(main())
