"""Train a small MLP on scikit-learn's digits with any bagua_lite algorithm, under torchrun.

    torchrun --nproc_per_node 4 examples/train.py --config examples/digits/gtopk.yaml --epochs 20

Each rank trains on its own shard; rank 0 prints the final loss and held-out accuracy.
"""
import argparse
import os

import torch.distributed as dist

import bagua_lite
from bagua_lite.demo import train_digits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()
    cfg = bagua_lite.load_config(args.config)  # validated before any process-group traffic
    dist.init_process_group("gloo")
    res = train_digits(cfg, epochs=args.epochs)
    if dist.get_rank() == 0:
        print(f"{os.path.basename(args.config)}: {cfg.algorithm!r} world_size={dist.get_world_size()} "
              f"final_loss={res['final_loss']:.4f} test_accuracy={res['accuracy']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
