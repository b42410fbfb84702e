"""Hugging Face transformers models under DistributedModel, on real gloo groups at P = 2 (tiny configs built
locally: 2 layers, hidden 32; no download).

GPT-2 (GPT2LMHeadModel: input and output embeddings tied), BertForMaskedLM (tied decoder) and
BertForPreTraining trained with the masked-LM loss only (its pooler and next-sentence head take part in the
forward but get no gradient) train for a few steps under one algorithm of each family. Checked on every rank:
the ModelOutput comes back through the wrapper (the loss is read from ``out.loss``, or from
``out.prediction_logits``); tied weights are still one tensor and equal everywhere; replicas are identical bit
for bit wherever the algorithm makes them so (the synchronous ones every step; local SGD and DiLoCo after
their average, which the last step is); parameters no rank uses keep ``.grad = None`` and stay bit for bit
as they were, as in a single-process run; and under gradient_allreduce the weights equal a single-process
run on the concatenated batch (all ranks' batches, in rank order) within 1e-5 absolute (float summation order
differs: measured differences are around 1e-7).
"""
import os

import pytest

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bagua_lite  # noqa: E402
from bagua_lite.algorithms import build  # noqa: E402

P = 2
B, T, VOCAB, STEPS = 4, 16, 64, 4
FAMILIES = {  # one algorithm per family; periods of 2 so that the last of STEPS steps is an average
    "gradient_allreduce": {},
    "gtopk": {"density": 0.05},
    "qadam": {"warmup_steps": 2},
    "local_sgd": {"period": 2},
    "decentralized": {},
    "diloco": {"period": 2},
}
IDENTICAL = ("gradient_allreduce", "gtopk", "qadam", "local_sgd", "diloco")  # replicas after the last step
TOL = 1e-5


def _model(kind):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4, use_cache=False,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=T, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0)
    return (transformers.BertForMaskedLM if kind == "bert_mlm" else transformers.BertForPreTraining)(cfg)


def _tied(kind, net):
    """(input embedding, output projection) that the model ties."""
    if kind == "gpt2":
        return net.transformer.wte.weight, net.lm_head.weight
    return net.bert.embeddings.word_embeddings.weight, net.cls.predictions.decoder.weight


def _unused(kind, net):
    """Parameters no rank's loss reaches: BertForPreTraining's pooler and next-sentence head under an MLM-only loss."""
    if kind != "bert_pretraining":
        return {}
    return {n: p for n, p in net.named_parameters() if n.startswith(("bert.pooler.", "cls.seq_relationship."))}


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    labels = torch.full_like(ids, -100)
    pos = torch.stack([torch.randperm(T, generator=g)[:3] for _ in range(B)])  # 3 masked tokens per sequence
    labels.scatter_(1, pos, ids.gather(1, pos))
    ids = ids.scatter(1, pos, 0)  # the [MASK] stand-in
    return ids, labels  # the same number of loss tokens on every rank: mean of means == mean of all


def _loss(kind, model, ids, labels):
    if kind == "gpt2":
        out = model(input_ids=ids, labels=ids)
        return out, out.loss
    if kind == "bert_mlm":
        out = model(input_ids=ids, labels=labels)
        return out, out.loss
    out = model(input_ids=ids)  # BertForPreTraining: MLM loss only, the NSP logits are not used
    return out, F.cross_entropy(out.prediction_logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def _optimizer(name, params):
    if name == "qadam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _train(kind, name, rank):
    net = _model(kind)
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = _optimizer(name, net.parameters())
    model = bagua_lite.DistributedModel(net, opt, build(name, **FAMILIES[name]), bucket_size_mb=0.05)
    out = {"outputs": set(), "unused_grad_none": True, "losses": []}
    for step in range(STEPS):
        result, loss = _loss(kind, model, *_batch(rank, step))
        out["outputs"].add(type(result).__name__)
        loss.backward()
        out["unused_grad_none"] &= all(p.grad is None for p in _unused(kind, net).values())
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    model.close()
    a, b = _tied(kind, net)
    out["tied"] = a is b and a.data_ptr() == b.data_ptr() and torch.equal(a, b)
    out["unused_unchanged"] = all(torch.equal(p, init[n]) for n, p in _unused(kind, net).items())
    out["weights"] = _flat(net)
    out["moved"] = not torch.equal(out["weights"], torch.cat([v.reshape(-1) for v in init.values()]))
    return out


def _reference(kind):
    """One process, SGD on the concatenation of all ranks' batches: what gradient_allreduce must reproduce."""
    net = _model(kind)
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = _optimizer("gradient_allreduce", net.parameters())
    for step in range(STEPS):
        batches = [_batch(r, step) for r in range(P)]
        _, loss = _loss(kind, net, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    unused_unchanged = all(torch.equal(p, init[n]) for n, p in _unused(kind, net).items())
    moved = not torch.equal(_flat(net), torch.cat([v.reshape(-1) for v in init.values()]))
    return _flat(net), unused_unchanged and moved


def _r_families(rank, world, kind):
    out = {name: _train(kind, name, rank) for name in FAMILIES}
    if rank == 0:
        out["reference"] = _reference(kind)
    return out


@pytest.mark.parametrize("kind, output", [("gpt2", "CausalLMOutputWithCrossAttentions"),
                                          ("bert_mlm", "MaskedLMOutput"),
                                          ("bert_pretraining", "BertForPreTrainingOutput")])
def test_hf_model_trains_under_every_family(clusters, kind, output):
    res = clusters.get(P).run(_r_families, kind, timeout=240)
    ref_weights, ref_ok = res[0]["reference"]
    assert ref_ok, "the single-process run did not train, or moved the pooler / NSP head"
    for name in FAMILIES:
        outs = [r[name] for r in res]
        for r, o in enumerate(outs):
            where = f"{kind} under {name}, rank {r}"
            assert o["outputs"] == {output}, f"{where}: the ModelOutput did not come through: {o['outputs']}"
            assert o["tied"], f"{where}: input and output embeddings are no longer one tensor"
            assert o["unused_grad_none"], f"{where}: a parameter no rank uses got a gradient"
            assert o["unused_unchanged"], f"{where}: the unused pooler / NSP head moved"
            assert o["moved"] and all(torch.isfinite(torch.tensor(o["losses"]))), (where, o["losses"])
        if name in IDENTICAL:
            assert all(torch.equal(o["weights"], outs[0]["weights"]) for o in outs), f"{kind} under {name}: replicas differ"
        if name == "gradient_allreduce":
            diff = (outs[0]["weights"] - ref_weights).abs().max().item()
            print(f"{kind}: gradient_allreduce vs single process on the concatenated batch: max |diff| {diff:.3g}")
            assert diff <= TOL, f"{kind}: gradient_allreduce differs from the single-process run by {diff:.3g}"
