"""Tests of bagua_lite.bench.netem: rate parsing, naming, and (as root) real namespaces, veths, bridge and tbf.

Where emulation is not available (not root, no iproute2, no netns support) the system tests do not skip:
they assert that ``available()`` explains why, so a broken setup cannot pass unnoticed as "skipped".
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from bagua_lite.bench import netem
from bagua_lite.bench.netem import NETWORKS, EmulatedNetwork, NetemError, available, parse_rate

AVAILABLE, WHY = available()


# ------------------------------------------------------------------------------------------ pure unit tests

@pytest.mark.parametrize("s,bps", [("10gbit", 10**10), ("1gbit", 10**9), ("100mbit", 10**8),
                                   ("500kbit", 5 * 10**5), ("2.5gbit", 25 * 10**8), (" 1GBIT ", 10**9),
                                   ("64000bit", 64000)])
def test_parse_rate(s, bps):
    assert parse_rate(s) == bps


@pytest.mark.parametrize("s", ["", "gbit", "10", "10gb", "10 gbps", "-1gbit", "1e9bit", "10Mbyte", "1bit"])
def test_parse_rate_rejects(s):
    with pytest.raises(ValueError) as e:
        parse_rate(s)
    assert repr(s) in str(e.value)


def test_parse_rate_error_names_allowed_forms():
    with pytest.raises(ValueError, match="gbit.*mbit|kbit"):
        parse_rate("fast")
    with pytest.raises(ValueError):
        parse_rate(1000)  # not a string


def test_networks_table():
    assert NETWORKS["loopback"] is None
    for name, rate in NETWORKS.items():
        if rate is not None:
            assert parse_rate(rate) > 0 and name == rate


def test_tbf_params_burst():
    # 10gbit: rate/HZ = 10e9/8/250 = 5 MB; 100mbit: 50 kB, raised to the 128 KiB floor.
    assert netem.tbf_params(10**10)["burst"] == 10**10 // 8 // netem.ASSUMED_HZ
    assert netem.tbf_params(10**8)["burst"] == netem.MIN_BURST_BYTES
    assert netem.tbf_params(10**9)["rate"] == "1000000000bit"


def test_names_and_addresses():
    net = EmulatedNetwork(4, "1gbit")
    assert [net.address(r) for r in range(4)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3", "10.77.0.4"]
    ifaces = [net.interface(r) for r in range(4)]
    assert len(set(ifaces)) == 4 and all(len(i) <= 15 for i in ifaces)
    assert len(net.bridge) <= 15 and str(os.getpid()) in net.tag
    assert net.command(2, ["python", "-c", "pass"]) == ["ip", "netns", "exec", net.namespace(2),
                                                        "python", "-c", "pass"]
    assert net.env(1)["GLOO_SOCKET_IFNAME"] == net.interface(1)
    with pytest.raises(IndexError):
        net.address(4)
    with pytest.raises(IndexError):
        net.command(-1, ["true"])
    # A second instance in the same process gets its own names.
    other = EmulatedNetwork(4, "1gbit")
    assert other.tag != net.tag and other.namespace(0) != net.namespace(0)
    # Names of an instance are recognised by the stale-leftover pattern (and carry the pid).
    pat = netem._stale_re("bl")
    for name in [net.bridge, net.namespace(3), net.interface(3), net._host_if(3), other.bridge]:
        m = pat.match(name)
        assert m and int(m.group(1)) == os.getpid(), name


def test_loopback_mode_creates_nothing():
    with EmulatedNetwork(3, None) as net:
        assert not net.emulated
        assert net.address(2) == "127.0.0.1" and net.interface(0) == "lo"
        assert net.command(1, ["echo", "hi"]) == ["echo", "hi"]


def test_invalid_arguments():
    with pytest.raises(ValueError):
        EmulatedNetwork(0, "1gbit")
    with pytest.raises(ValueError):
        EmulatedNetwork(2, "1gigabit")
    with pytest.raises(ValueError, match="prefix"):
        EmulatedNetwork(2, "1gbit", prefix="b2")  # digits would make the pid ambiguous
    with pytest.raises(ValueError, match="15"):
        EmulatedNetwork(100, "1gbit", prefix="averylongprefix")


# ------------------------------------------------------------------------------------------ system tests

def _leftovers(tag):
    names = netem._list_netns() + netem._list_links()
    return [n for n in names if n.startswith(tag)]


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def test_available_reports_reason():
    if AVAILABLE:
        assert WHY == ""
    else:
        assert isinstance(WHY, str) and len(WHY) > 10, f"unclear reason: {WHY!r}"
        if os.geteuid() != 0:
            assert "root" in WHY


_ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    c, _ = srv.accept()
    c.sendall(c.recv(100).upper())
    c.close()
""")

_ECHO_CLIENT = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    s.sendall(b"ping from the other namespace")
    print(s.recv(100).decode())
""")


def test_real_network_roundtrip():
    if not AVAILABLE:
        assert WHY  # see test_available_reports_reason: the reason is the result here
        return
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a run started under nohup
    with EmulatedNetwork(2, "1gbit") as net:
        tag = net.tag
        # Everything exists: namespaces, bridge, host veth ends with tbf, namespace ends with tbf and address.
        assert {net.namespace(0), net.namespace(1)} <= set(netem._list_netns())
        assert {net.bridge, net._host_if(0), net._host_if(1)} <= set(netem._list_links())
        for r in range(2):
            out = _run(net.command(r, ["ip", "addr"]))
            assert out.returncode == 0, out.stderr
            assert f"inet {net.address(r)}/24" in out.stdout and net.interface(r) in out.stdout
            lo = _run(net.command(r, ["ip", "link", "show", "lo"])).stdout
            assert "UP" in lo.split(">")[0], lo
            qd = _run(net.command(r, ["tc", "qdisc", "show", "dev", net.interface(r)])).stdout
            assert "tbf" in qd and "rate 1Gbit" in qd, qd
            qd = _run(["tc", "qdisc", "show", "dev", net._host_if(r)]).stdout
            assert "tbf" in qd and "rate 1Gbit" in qd, qd
        # The host cannot see the namespace-side interfaces.
        assert net.interface(0) not in netem._list_links()
        # A TCP round trip from rank 0's namespace to rank 1's.
        srv = subprocess.Popen(net.command(1, [sys.executable, "-c", _ECHO_SERVER, net.address(1), "7777"]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
            cli = _run(net.command(0, [sys.executable, "-c", _ECHO_CLIENT, net.address(1), "7777"]))
            assert cli.returncode == 0, cli.stderr
            assert cli.stdout.strip() == "PING FROM THE OTHER NAMESPACE"
        finally:
            srv.kill()
            srv.wait()
        # Rank 0's namespace is isolated from the host: the host's own interfaces are not there.
        links0 = _run(net.command(0, ["ip", "-o", "link"])).stdout
        assert net._host_if(0) not in links0 and net.bridge not in links0
    assert _leftovers(tag) == []
    net.cleanup()  # idempotent
    assert signal.getsignal(signal.SIGINT) is before


def test_cleanup_on_exception_and_handlers_restored():
    if not AVAILABLE:
        assert WHY
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(ZeroDivisionError):
        with EmulatedNetwork(2, "100mbit") as net:
            tag = net.tag
            assert signal.getsignal(signal.SIGTERM) == net._on_signal
            1 / 0
    assert _leftovers(tag) == []
    assert {s: signal.getsignal(s) for s in before} == before


def test_failed_setup_cleans_up_and_names_command():
    if not AVAILABLE:
        assert WHY
        return
    net = EmulatedNetwork(2, "1gbit")
    # Occupy rank 1's host veth name so that creating it fails half way through.
    assert _run(["ip", "link", "add", net._host_if(1), "type", "bridge"]).returncode == 0
    try:
        with pytest.raises(NetemError) as e:
            net.__enter__()
        assert "ip link add" in str(e.value) and e.value.stderr
        left = _leftovers(net.tag)
        assert left == [net._host_if(1)], left  # only the blocker we made ourselves
    finally:
        _run(["ip", "link", "del", net._host_if(1)])
    assert _leftovers(net.tag) == []


_SIGNAL_CHILD = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("netem_by_path", sys.argv[1])
    netem = importlib.util.module_from_spec(spec); spec.loader.exec_module(netem)
    with netem.EmulatedNetwork(2, "1gbit") as net:
        print(net.tag, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cleanup_on_signal(sig):
    if not AVAILABLE:
        assert WHY
        return
    # the child starts with SIGINT's default disposition even where this run inherited it ignored (nohup, a
    # background job): Python then installs KeyboardInterrupt for it, as in a terminal
    p = subprocess.Popen([sys.executable, "-c", _SIGNAL_CHILD, netem.__file__],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        tag = p.stdout.readline().strip()
        assert tag, p.stderr.read()
        assert _leftovers(tag)  # the network is up
        p.send_signal(sig)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    # Dies of the signal as it would have without the network (SIGINT: via KeyboardInterrupt).
    assert p.returncode == -sig, (p.returncode, p.stderr.read())
    assert _leftovers(tag) == []


def test_cleanup_stale():
    if not AVAILABLE:
        assert WHY
        return
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not netem._pid_alive(dead.pid)
    tag = f"bl{dead.pid}"
    try:
        assert _run(["ip", "netns", "add", f"{tag}ns0"]).returncode == 0
        assert _run(["ip", "link", "add", f"{tag}b", "type", "bridge"]).returncode == 0
        assert _run(["ip", "link", "add", f"{tag}h0", "type", "veth", "peer", "name", f"{tag}n0",
                     "netns", f"{tag}ns0"]).returncode == 0
        with EmulatedNetwork(2, "1gbit") as live:  # a live run's network must survive
            removed = netem.cleanup_stale("bl")
            assert set(removed) >= {f"{tag}ns0", f"{tag}b", f"{tag}h0"}
            assert _leftovers(tag) == []
            assert not [n for n in removed if n.startswith(live.tag)]
            assert len(_leftovers(live.tag)) == 2 + 3  # 2 namespaces, 2 host veths, 1 bridge
    finally:
        for cmd in (["ip", "link", "del", f"{tag}h0"], ["ip", "link", "del", f"{tag}b"],
                    ["ip", "netns", "del", f"{tag}ns0"]):
            _run(cmd)


def test_throughput_is_limited():
    """A quick version of the self-test: 100mbit must deliver close to, and not above, 100 Mbit/s."""
    if not AVAILABLE:
        assert WHY
        return
    with EmulatedNetwork(2, "100mbit") as net:
        bps = netem.measure_throughput(net, seconds=1.5)
    # TCP goodput over 1500-byte frames is at most 1448/1514 = 95.6% of the line rate.
    assert 0.80e8 < bps < 1.02e8, bps


def test_ranks_of_one_node_talk_over_its_loopback():
    """ranks_per_node: two ranks in one namespace (a node) allreduce over its loopback, not the rate-limited
    veth; the same two ranks one per node pay the link (4 MB at 100 Mbit/s: at least 0.32 s)."""
    if not AVAILABLE:
        assert WHY
        return
    with EmulatedNetwork(2, "100mbit") as net:
        inside = netem.measure_allreduce(net, numel=1_000_000, iters=2, ranks_per_node=2, nodes=1)
        across = netem.measure_allreduce(net, numel=1_000_000, iters=2, ranks_per_node=1)
    assert inside["ok"] and across["ok"]
    assert across["mean_s"] > 0.3, across
    assert inside["mean_s"] < across["mean_s"] / 5, (inside, across)
