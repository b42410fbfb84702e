"""The two decentralized algorithms over one peer exchange (algorithms/parts/gossip.py), without a process group:
``decentralized`` with a ``compression`` is the compressed exchange under decentralized's name, options and
defaults, for training and for the cost model alike. (Training: tests/test_training.py's decentralized tests.)"""
import pytest

from bagua_lite import cost_model as cm
from bagua_lite.algorithms import build
from bagua_lite.algorithms.decentralized import Decentralized
from bagua_lite.algorithms.low_precision_decentralized import LowPrecisionDecentralized


def test_decentralized_with_a_compression_is_the_compressed_exchange():
    exact = build("decentralized", peer_selection="shift_one")
    assert type(exact) is Decentralized and exact.name == "decentralized"
    for alg in (build("decentralized", compression="fp16", consensus_step=0.5), Decentralized(compression="fp16",
                                                                                             consensus_step=0.5)):
        assert isinstance(alg, LowPrecisionDecentralized) and alg.name == "decentralized"
        assert alg.options() == {"peer_selection": "ring", "communication_interval": 1, "compression": "fp16",
                                 "consensus_step": 0.5}  # decentralized's defaults, not low_precision's
    lp = build("low_precision_decentralized")
    assert lp.name == "low_precision_decentralized" and (lp.peer_selection, lp.compressor.name) == \
        ("ring_one_way", "minmax_uint8")
    with pytest.raises(ValueError, match=r"^decentralized: unknown compression 'int8'"):
        build("decentralized", compression="int8")


def test_a_subclass_of_the_exact_exchange_refuses_a_compression():
    class Mine(Decentralized):
        pass
    assert type(Mine()) is Mine
    with pytest.raises(ValueError, match=r"Mine exchanges weights, not compression='fp16'"):
        Mine(compression="fp16")


def test_the_cost_model_sees_the_same_split():
    m = cm.Machine(topk_s_per_elem=1e-9, quantize_s_per_elem=2e-9, fp16_s_per_elem=1e-9, add_s_per_elem=1e-9)
    for P in (2, 3, 4):
        for mode in ("ring", "ring_one_way", "all"):
            o = {"peer_selection": mode, "communication_interval": 2, "compression": "minmax_uint8"}
            lp = LowPrecisionDecentralized.traffic(o, P, [600, 400], 4, m)
            assert Decentralized.traffic(o, P, [600, 400], 4, m) == lp and lp.thread_s > 0
    t = Decentralized.traffic({"peer_selection": "ring", "communication_interval": 1, "compression": "none"}, 4, [1000])
    assert (t.when, t.exchange, t.messages) == ("with_step", (8000, 1, 8000), 2)  # both neighbours, 4000 B each


def _r_staged(rank, P, name, options):
    """Train with the peer exchange staged through host buffers (what gloo needs for CUDA tensors: forced
    here on CPU tensors) and without; both runs' weights."""
    import torch
    import torch.nn.functional as F

    import bagua_lite
    from bagua_lite.algorithms.parts import peers as _peers

    def run():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(10, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model = bagua_lite.DistributedModel(net, opt, build(name, **options), bucket_size_mb=0.001)
        for step in range(5):
            x = torch.randn(8, 10, generator=torch.Generator().manual_seed(rank * 100 + step))
            F.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
            opt.step()
            opt.zero_grad()
        hosts = len(model.algorithm.peers._host)
        model.close()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), hosts

    plain, _ = run()
    original = _peers.Peers.staged
    _peers.Peers.staged = lambda self, t: t.dtype != torch.int64  # every data buffer, not the step pairs
    try:
        staged, hosts = run()
    finally:
        _peers.Peers.staged = original
    return torch.equal(plain, staged), hosts


@pytest.mark.parametrize("name,options", [("decentralized", {}), ("decentralized", {"peer_selection": "shift_one"}),
                                          ("low_precision_decentralized", {})])
def test_a_peer_exchange_staged_through_the_host_is_the_same_exchange(clusters, name, options):
    for same, hosts in clusters.get(3).run(_r_staged, name, options):
        assert same, f"{name} {options}: staging through host buffers changed the result"
        assert hosts > 0, "nothing was staged"
