"""torchft's train_diloco.py training loop in miniature: its DiLoCo idioms as written there (a Manager per
replica group with a lighthouse, torchft's ProcessGroupGloo, the outer optimizer, the DiLoCo context
manager around the inner loop), a tiny model and synthetic data so that it runs on CPUs in seconds.
diloco_torchft.py is the original, diloco_bagua_lite.py its port (docs/porting.md shows the diff).
The original: start a lighthouse (`torchft_lighthouse --min_replicas 2`), then one torchrun per replica
group with `REPLICA_GROUP_ID=<i> TORCHFT_LIGHTHOUSE=http://<host>:<port> torchrun --nproc_per_node 1
--master_port <29600 + i> diloco_torchft.py`. The port: `torchrun --nproc_per_node 2 diloco_bagua_lite.py`.
"""
import os
from datetime import timedelta

import bagua_lite
import torch
import torch.nn as nn
import torch.nn.functional as F

REPLICA_GROUP_ID = int(os.environ.get("RANK", 0))
sync_every, steps, vocab_size, n_embd = 5, 20, 64, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, vocab_size))

    def forward(self, idx):
        return self.mlp(self.wte(idx))


torch.manual_seed(0)
m = TinyLM()
inner_optimizer = torch.optim.AdamW(m.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
diloco = bagua_lite.algorithms.build("diloco", period=sync_every, outer_optimizer={
    "name": "SGD", "lr": 0.7, "momentum": 0.9, "nesterov": True})
model = bagua_lite.DistributedModel(m, inner_optimizer, algorithm=diloco)
g = torch.Generator().manual_seed(100 + REPLICA_GROUP_ID)  # each replica group its own batches
for step in range(steps):
    tokens = torch.randint(vocab_size, (8, 17), generator=g)
    inner_optimizer.zero_grad()
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    inner_optimizer.step()
    print(f"replica {REPLICA_GROUP_ID} step {step}: loss {loss.item()!r}", flush=True)
model.close()
torch.distributed.destroy_process_group()
