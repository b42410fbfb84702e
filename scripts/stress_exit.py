"""Stress the end of a training run: run examples/train.py many times, under CPU load, and count aborts.

    python scripts/stress_exit.py --runs 200 --budget-min 40           # torchrun, every algorithm config
    python scripts/stress_exit.py --kill-peer --runs 14 --epochs 200   # SIGKILL rank 2 after 12 s

Default mode: ``python -m torch.distributed.run --standalone --nproc_per_node 4 examples/train.py --config
configs/<name>.yaml --epochs 2`` for every algorithm config (``configs/*.yaml`` except ``benchmark*``), in
turn, with ``--burners`` CPU-burning processes (``while True: pass``) beside it and OMP_NUM_THREADS=1. Each
run is classified: ``ok`` (exit 0 and rank 0's result line), ``abort`` (SIGABRT, "terminate called", or a
rank's exit code -6), ``fail`` (anything else). The log of every run that is not ``ok`` is kept in --logs.
With ``--cores`` each rank may dump core (``ulimit -c unlimited``) into its run's folder, for gdb.

``--kill-peer``: the ranks are started here directly (env:// rendezvous, no torchrun, whose agent would
SIGTERM the survivors itself), one rank (``--kill-rank``, not 0: rank 0 hosts the store) is SIGKILLed
``--kill-after`` seconds after training started, and every survivor must exit 1 with an error message,
never by a signal.
"""
import argparse
import glob
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^\S+\.yaml: .* test_accuracy=[0-9.]+$", re.M)
ABORT = re.compile(r"terminate called|SIGABRT|Signal 6|exitcode\s*:\s*-6|core dumped")


def algorithm_configs():
    from bagua_lite.demo import digits_configs

    return digits_configs(ROOT)


def start_burners(n):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_burners(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _cores_on():
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def env_base():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")


def run_torchrun(cfg, args, rundir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           os.path.join(ROOT, "examples", "train.py"), "--config", cfg, "--epochs", str(args.epochs)]
    try:
        proc = subprocess.run(cmd, cwd=rundir, env=env_base(), capture_output=True, text=True, timeout=args.timeout,
                              preexec_fn=_cores_on if args.cores else None)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return "timeout", None, out
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 and LINE.search(proc.stdout):
        return "ok", 0, out
    if ABORT.search(out) or proc.returncode in (-6, 134):
        return "abort", proc.returncode, out
    return "fail", proc.returncode, out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kill_peer(cfg, args, rundir):
    """Ranks started directly; one SIGKILLed mid-run. Returns (outcome, {rank: exit code}, output)."""
    port = _free_port()
    procs, logs = [], []
    for r in range(args.nproc):
        env = dict(env_base(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(os.path.join(rundir, f"rank{r}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "train.py"), "--config", cfg,
                                       "--epochs", str(args.epochs)], cwd=rundir, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, preexec_fn=_cores_on if args.cores else None))
    time.sleep(args.kill_after)
    victim = procs[args.kill_rank]
    killed = victim.poll() is None
    if killed:
        victim.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    codes, out = {}, ""
    for r, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read()
        log.close()
        codes[r] = "hung" if p.returncode == -signal.SIGKILL and r != args.kill_rank else p.returncode
        out += f"==== rank {r}: exit {codes[r]}\n{text[-4000:]}\n"
    if not killed or all(codes[r] == 0 for r in codes if r != args.kill_rank):
        return "late-kill (training had finished)", codes, out
    survivors = {r: c for r, c in codes.items() if r != args.kill_rank}
    if all(c == 1 for c in survivors.values()):
        texts = [open(os.path.join(rundir, f"rank{r}.log")).read() for r in survivors]
        if all(("Error" in t) for t in texts):
            return "ok", codes, out
        return "fail (exit 1 without an error message)", codes, out
    if any(c in (-6, 134) for c in survivors.values()) or ABORT.search(out):
        return "abort", codes, out
    return "fail", codes, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=26, help="total runs, round-robin over the configs")
    ap.add_argument("--configs", nargs="*", default=None, help="default: every algorithm config")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--budget-min", type=float, default=20.0, help="stop starting runs after this many minutes")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--logs", default=os.path.join(tempfile.gettempdir(), "bagua_lite_stress"))
    ap.add_argument("--cores", action="store_true", help="ulimit -c unlimited for the ranks (core files per run)")
    ap.add_argument("--kill-peer", action="store_true")
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-after", type=float, default=12.0,
                    help="seconds after the start (set-up takes 5-10 s on 2 cores)")
    ap.add_argument("--stop-on-abort", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the logs of every run, not only of failed ones")
    args = ap.parse_args()
    configs = [os.path.abspath(c) for c in args.configs] if args.configs else algorithm_configs()
    os.makedirs(args.logs, exist_ok=True)
    burners = start_burners(args.burners)
    tally, per_config, t0 = Counter(), defaultdict(Counter), time.monotonic()
    try:
        for i in range(args.runs):
            if time.monotonic() - t0 > args.budget_min * 60:
                print(f"budget of {args.budget_min} min reached after {i} runs", flush=True)
                break
            cfg = configs[i % len(configs)]
            name = os.path.basename(cfg)[:-5]
            rundir = tempfile.mkdtemp(prefix=f"run{i:03d}_{name}_", dir=args.logs)
            t = time.monotonic()
            if args.kill_peer:
                outcome, codes, out = run_kill_peer(cfg, args, rundir)
            else:
                outcome, codes, out = run_torchrun(cfg, args, rundir)
            kind = outcome.split()[0]
            tally[kind] += 1
            per_config[name][kind] += 1
            print(f"[{i + 1}/{args.runs} {time.monotonic() - t0:6.0f}s] {name:<28} {outcome:<10} exit={codes} "
                  f"({time.monotonic() - t:.1f}s)", flush=True)
            if kind == "ok" and not args.keep and not glob.glob(os.path.join(rundir, "core*")):
                shutil.rmtree(rundir, ignore_errors=True)
            else:
                with open(os.path.join(rundir, "output.txt"), "w") as f:
                    f.write(out)
                for line in out.splitlines():
                    if ABORT.search(line) or "Error" in line:
                        print("    " + line[:200], flush=True)
                print(f"    log: {rundir}", flush=True)
                if kind == "abort" and args.stop_on_abort:
                    break
    finally:
        stop_burners(burners)
    print(f"total: {sum(tally.values())} runs in {time.monotonic() - t0:.0f}s: {dict(tally)}")
    for name, c in sorted(per_config.items()):
        print(f"  {name:<28} {dict(c)}")
    return 0 if set(tally) <= {"ok", "late-kill"} else 1


if __name__ == "__main__":
    sys.exit(main())
