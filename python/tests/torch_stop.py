"""A rank that stops (SIGSTOP) during a job: every other rank raises within the group's timeout
(+ 2 s) naming it, and nothing hangs. Run by torchrun (tests/CMakeLists.txt):

    python3 -m torch.distributed.run --standalone --redirects 2 --tee 2 --nproc_per_node 4 torch_stop.py --victim 3

The victim stops itself just before an all_to_all_single that every other rank makes; the rank
after it, once it has raised and the others have had their time to, wakes the victim with SIGCONT, whose call then fails too (the group's
bootstrap is gone) and every process exits. Rank 0 prints each survivor's time to raise.
"""

import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import fasta2a_torch  # noqa: F401

parser = argparse.ArgumentParser()
parser.add_argument("--victim", type=int, default=-1, help="the rank that stops (default: the last)")
parser.add_argument("--timeout", type=float, default=5.0, help="the group's timeout, seconds")
args = parser.parse_args()

dist.init_process_group("fasta2a", timeout=datetime.timedelta(seconds=args.timeout))
rank, n = dist.get_rank(), dist.get_world_size()
victim = args.victim % n
x = torch.arange(n * 4, dtype=torch.float32)
y = torch.empty_like(x)
dist.all_to_all_single(y, x)  # a call that works first
pids = [None] * n
dist.all_gather_object(pids, os.getpid())

t0 = time.monotonic()
error = ""
try:
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_to_all_single(y, x)
except RuntimeError as e:
    error = str(e)
took = time.monotonic() - t0
if rank == (victim + 1) % n:
    # Not before every survivor has had its time to raise: a victim woken earlier may finish the
    # counts exchange with a survivor still waiting in it (the blobs were in its sockets), which
    # then waits for the victim's signals instead (seen once in CI: 11.5 s with a 5 s timeout).
    time.sleep(max(0.0, args.timeout + 2.5 - (time.monotonic() - t0)))
    os.kill(pids[victim], signal.SIGCONT)

ok = True
if rank != victim:
    named = f"rank {victim}" in error
    in_time = took <= args.timeout + 2.0
    print(f"rank {rank}: raised after {took:.2f} s (timeout {args.timeout:g} s), names rank {victim}: {named}: {error}",
          flush=True)
    ok = bool(error) and named and in_time
print(f"rank {rank}: {'ok' if ok else 'FAILED'}", flush=True)
# Exit without the group's teardown: its bootstrap is gone, which is what this test is about.
sys.stdout.flush()
os._exit(0 if ok else 1)
