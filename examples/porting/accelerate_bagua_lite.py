"""Hugging Face's run_clm_no_trainer.py training loop in miniature: its Accelerate idioms as written there
(prepare of model, optimizer, loader and scheduler; accumulate; backward; sync_gradients; save_state), a
tiny language model and synthetic data so that it runs on CPUs in seconds. accelerate_ddp.py is the
original, accelerate_bagua_lite.py its port (docs/porting.md shows the diff). Run either with

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 <file> [output_dir]
"""
import sys

import bagua_lite
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

vocab_size, block_size, n_embd = 64, 16, 32
per_device_train_batch_size, num_train_epochs, learning_rate = 4, 2, 1e-3
output_dir = sys.argv[1] if len(sys.argv) > 1 else None


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, vocab_size))

    def forward(self, input_ids, labels):
        logits = self.mlp(self.wte(input_ids))
        return F.cross_entropy(logits.view(-1, vocab_size), labels.view(-1))


accelerator = Accelerator(gradient_accumulation_steps=2)
set_seed(42)
tokens = torch.randint(vocab_size, (48, block_size + 1))
train_dataset = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
train_dataloader = torch.utils.data.DataLoader(train_dataset, shuffle=True, batch_size=per_device_train_batch_size)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
model = bagua_lite.DistributedModel(model, optimizer, algorithm="gradient_allreduce", accelerator=accelerator)

model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, lr_scheduler)

completed_steps = 0
for epoch in range(num_train_epochs):
    model.train()
    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate(model):
            loss = model(**batch)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        print(f"rank {accelerator.process_index} step {epoch}.{step}: loss {loss.item()!r}", flush=True)
    if output_dir is not None:
        accelerator.save_state(f"{output_dir}/epoch_{epoch}")
accelerator.end_training()
