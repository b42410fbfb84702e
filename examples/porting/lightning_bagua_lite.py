"""Lightning's examples/pytorch/basics/transformer.py in miniature: the unified `lightning` package, a
LightningModule, a Trainer that launches its own processes with a DDP strategy, a tiny language model and
synthetic data so that it runs on CPUs in seconds. lightning_ddp.py is the original,
lightning_bagua_lite.py its port (docs/porting.md shows the diff). Run either with

    python <file>
"""
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from bagua_lite.lightning import BaguaLiteStrategy

vocab_size, block_size, n_embd = 64, 16, 32


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, vocab_size))

    def training_step(self, batch, batch_idx):
        input, target = batch
        output = self.mlp(self.wte(input))
        loss = F.cross_entropy(output.view(-1, vocab_size), target.view(-1))
        print(f"rank {self.global_rank} step {batch_idx}: loss {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main():
    L.seed_everything(42)
    tokens = torch.randint(vocab_size, (64, block_size + 1))
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    train_dataloader = torch.utils.data.DataLoader(dataset, batch_size=4)
    model = LanguageModel()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, gradient_clip_val=0.25, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=BaguaLiteStrategy("gradient_allreduce"))
    trainer.fit(model, train_dataloader)


if __name__ == "__main__":
    main()
