"""nanoGPT's train.py training loop in miniature: its DDP idioms as written there (RANK from torchrun, the
optimizer built before the DDP wrap, gradient accumulation through require_backward_grad_sync, GradScaler,
clipping), a tiny model and synthetic data so that it runs on CPUs in seconds. nanogpt_ddp.py is the
original, nanogpt_bagua_lite.py its port (docs/porting.md shows the diff). Run either with

    torchrun --standalone --nproc_per_node 2 <file>
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

gradient_accumulation_steps = 4
batch_size, block_size, vocab_size, n_embd = 8, 16, 64, 32
max_iters, learning_rate, weight_decay, grad_clip = 12, 1e-3, 0.1, 1.0


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        logits = self.lm_head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))


ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    init_process_group(backend='gloo')
    ddp_rank = int(os.environ['RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, seed_offset = 0, 0
torch.manual_seed(1337)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
model = TinyGPT()
torch.manual_seed(1337 + seed_offset)  # each rank its own batches
data = torch.randint(vocab_size, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


scaler = torch.amp.GradScaler('cpu', enabled=False)  # nanoGPT: enabled=(dtype == 'float16')
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.95))
if ddp:
    model = DDP(model)

X, Y = get_batch()
for iter_num in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # in DDP training we only need to sync gradients at the last micro step
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"rank {ddp_rank} iter {iter_num}: loss {loss.item() * gradient_accumulation_steps!r}", flush=True)

if ddp:
    destroy_process_group()
