"""Train a small MLP on scikit-learn's digits with any bagua_lite algorithm, under torchrun.

    torchrun --nproc_per_node 4 examples/train.py --config examples/digits/gtopk.yaml --epochs 20

Each rank trains on its own shard; rank 0 prints the final loss and held-out accuracy. Several configs
(``--config a.yaml b.yaml``) are trained in turn, each from the same start, in one process group: every
config is checked before the group starts.
"""
import argparse
import os

import torch.distributed as dist

import bagua_lite
from bagua_lite.demo import train_digits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, nargs="+", help="one or more config files, trained in turn")
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()
    configs = [(path, bagua_lite.load_config(path)) for path in args.config]  # all checked before any traffic
    dist.init_process_group("gloo")
    for path, cfg in configs:
        res = train_digits(cfg, epochs=args.epochs)
        if dist.get_rank() == 0:
            print(f"{os.path.basename(path)}: {cfg.algorithm!r} world_size={dist.get_world_size()} "
                  f"final_loss={res['final_loss']:.4f} test_accuracy={res['accuracy']:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
