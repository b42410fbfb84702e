"""Elastic restarts: checkpoint every N steps, and let torchrun restart the group when a worker dies.

    torchrun --nproc_per_node 3 --max-restarts 3 examples/elastic.py --ckpt /tmp/ckpt --steps 40 --every 5

After a worker dies, torchrun stops the others and starts the whole group again (``--max-restarts``);
every worker then resumes from the newest *complete* checkpoint (``LATEST`` names it; rank 0 writes it
only after ``save_checkpoint`` returned on every rank), so no step is lost and none is applied twice:
the final weights equal those of a run without the failure. ``--kill-at S --kill-rank R`` makes rank R
kill itself at step S in the first attempt (to try it). Data are a pure function of (rank, step), as a
sampler's order is of (epoch, seed), so a resumed step sees the batch it would have seen.
``--out FILE``: rank 0 saves the final weights there.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_lite


def batch(rank, step, d_in=32, classes=10, n=32):
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(n, d_in, generator=g)
    return x, (x[:, :classes] * 2 + x[:, classes:2 * classes]).argmax(1)


def latest(ckpt):
    try:
        with open(os.path.join(ckpt, "LATEST")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (shared by the workers)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    ap.add_argument("--algorithm", default="gtopk")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    # not dist.init_process_group(): torchrun's store outlives a restart, and a new attempt's group would
    # read the failed one's keys; bagua_lite's gives each attempt a store prefix of its own
    bagua_lite.init_process_group()
    attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = bagua_lite.DistributedModel(net, opt, algorithm=args.algorithm, bucket_size_mb=0.01)

    start, name = 0, latest(args.ckpt)
    if name is not None:
        start = bagua_lite.load_checkpoint(os.path.join(args.ckpt, name), model, opt)["step"]
        if rank == 0:
            print(f"attempt {attempt}: resuming from {name} (step {start})", flush=True)
    for step in range(start, args.steps):
        if step == args.kill_at and rank == args.kill_rank and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker
        x, y = batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            name = f"step{step + 1}"
            bagua_lite.save_checkpoint(os.path.join(args.ckpt, name), model, opt, step=step + 1)
            if rank == 0:  # every rank's file is written (save_checkpoint is collective): publish it
                tmp = os.path.join(args.ckpt, "LATEST.tmp")
                with open(tmp, "w") as f:
                    f.write(name)
                os.replace(tmp, os.path.join(args.ckpt, "LATEST"))
    if rank == 0 and args.out:
        torch.save([p.detach().clone() for p in net.parameters()], args.out)
        print(f"attempt {attempt}: done, {args.steps} steps", flush=True)
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
