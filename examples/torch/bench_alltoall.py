"""fasta2a against gloo: torch.distributed.all_to_all_single in the same job, alternating.

Every rank makes the default group with the "fasta2a" backend and a gloo group over the same ranks.
For each workload it runs one warm-up call on each, then --iters calls alternating fasta2a, gloo;
a call's time is the slowest rank's (a max all-reduce over gloo after the call, outside the
timing), and the first call's received bytes are compared between the two (they must be equal).
Rank 0 prints a table and, with --json, writes one JSON object per workload.

Workloads (rows of --row-bytes, every rank computes the same matrix from --seed):
  zipf:S:B       Zipf(S) destinations (one popularity order shared by every sender, per-pair jitter
                 in [0.75, 1.25)), B bytes per rank (e.g. zipf:1.0:16M)
  hotspot:B      half of every rank's B bytes to one hot rank, the rest spread evenly
  uniform:B      B bytes per rank spread evenly
  megatron:K     matrix K of the Megatron trace (32 x 32 tokens, folded onto the world by block
                 sums), --row-bytes per token
  small:B        B bytes per rank pair (the fixed cost per call: the Python path's time beside the
                 C++ engine's own time for the same call, from the backend's stats)

On one machine:

    python3 -m torch.distributed.run --standalone --redirects 2 --tee 2 --nproc_per_node 4 \\
        examples/torch/bench_alltoall.py --workloads zipf:1.0:4M,uniform:4M,small:4K

On the emulated cluster (examples/cluster/cluster.sh up 4 4 200), each rank on its own NIC for
both backends (emulated_cluster.py: the launcher sets FASTA2A_NIC; gloo's connecting sockets,
which gloo never binds, are bound to the rank's address by the preloaded bind_source library):

    examples/cluster/cluster.sh launch -- env PYTHONPATH=build/python \\
        LD_PRELOAD=build/examples/cluster/libfasta2a_bind_source.so /usr/bin/python3 \\
        examples/torch/bench_alltoall.py --nic-mbit 200 --json results.jsonl
"""

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import time

from emulated_cluster import pin_to_nic

pin_to_nic()  # on the emulated cluster: this rank's NIC for fasta2a and gloo alike

import torch
import torch.distributed as dist

try:
    import fasta2a_torch  # noqa: F401  (registers the backend)
except ImportError as e:
    sys.exit(f"bench_alltoall: cannot import fasta2a_torch ({e}): build with cmake and set "
             f"PYTHONPATH=<build>/python")


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--workloads", default="zipf:1.0:16M,zipf:1.0:4M,hotspot:8M,uniform:16M,uniform:1M,"
                    "megatron:299,small:4K")
parser.add_argument("--iters", type=int, default=3, help="timed calls per backend (default 3)")
parser.add_argument("--row-bytes", type=int, default=4096, help="bytes per row / token (default 4096)")
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--nic-mbit", type=float, default=0, help="NIC rate, for the ratio to LB_server")
parser.add_argument("--trace", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "../../../shared/workloads/megatron-4n-32gpu.txt"))
parser.add_argument("--timeout", type=float, default=300)
parser.add_argument("--json", default="", help="rank 0 appends one JSON object per workload")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("fasta2a", timeout=datetime.timedelta(seconds=args.timeout))
rank, n = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(list(range(n)), backend="gloo")
G = int(os.environ.get("FASTA2A_GPUS_PER_SERVER") or os.environ.get("LOCAL_WORLD_SIZE") or n)
S = n // G


def apportion(weights, units):
    """Integer rows proportional to weights, summing exactly to units (largest remainders)."""
    total = sum(weights)
    raw = [w / total * units for w in weights]
    rows = [int(math.floor(r)) for r in raw]
    left = units - sum(rows)
    for j in sorted(range(len(raw)), key=lambda j: (-(raw[j] - rows[j]), j))[:left]:
        rows[j] += 1
    return rows


def matrix(spec):
    """Rows rank i sends rank j, the same on every rank."""
    kind, _, rest = spec.partition(":")
    rng = random.Random(args.seed)
    rb = args.row_bytes
    if kind == "zipf":
        s, b = rest.split(":")
        order = list(range(n))
        rng.shuffle(order)
        pop = [0.0] * n
        for p, r in enumerate(order):
            pop[r] = (1.0 / (p + 1)) ** float(s)
        units = parse_bytes(b) // rb
        return [apportion([pop[j] * (0.75 + 0.5 * rng.random()) for j in range(n)], units) for _ in range(n)]
    if kind == "hotspot":
        units = parse_bytes(rest) // rb
        hot = rng.randrange(n)
        T = []
        for _ in range(n):
            cold = apportion([0.0 if j == hot else 1.0 for j in range(n)], units - units // 2)
            cold[hot] = units // 2
            T.append(cold)
        return T
    if kind == "uniform":
        units = parse_bytes(rest) // rb
        return [apportion([1.0] * n, units) for _ in range(n)]
    if kind == "small":
        return [[max(1, parse_bytes(rest) // rb)] * n for _ in range(n)]
    if kind == "megatron":
        k = int(rest)
        with open(args.trace) as f:
            vals = [int(v) for _, v in zip(range((k + 1) * 1024), f)][k * 1024:]
        if 32 % n:
            raise SystemExit(f"bench_alltoall: {n} ranks do not divide the trace's 32")
        f_ = 32 // n
        T = [[0] * n for _ in range(n)]
        for i in range(32):
            for j in range(32):
                T[i // f_][j // f_] += vals[i * 32 + j]
        return T
    raise SystemExit(f"bench_alltoall: unknown workload {spec!r}")


def lb_server_s(T):
    """The scale-out lower bound: the busiest server's bytes leaving or entering, over its G NICs."""
    if not args.nic_mbit or S < 2:
        return 0.0
    rb = args.row_bytes
    worst = 0
    for s in range(S):
        mine = range(s * G, (s + 1) * G)
        out = sum(T[i][j] for i in mine for j in range(n) if j // G != s) * rb
        inn = sum(T[i][j] for j in mine for i in range(n) if i // G != s) * rb
        worst = max(worst, out, inn)
    return worst / (G * args.nic_mbit * 1e6 / 8)


def slowest(t):
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=gloo)
    return x.item()


pg = dist.distributed_c10d._get_default_group()
results = []
for spec in args.workloads.split(","):
    T = matrix(spec)
    ins = T[rank]
    outs = [T[i][rank] for i in range(n)]
    cols = args.row_bytes // 4
    x = torch.randn(sum(ins), cols, generator=torch.Generator().manual_seed(rank + 17))
    y_fa = torch.empty(sum(outs), cols)
    y_gl = torch.empty(sum(outs), cols)
    times = {"fasta2a": [], "gloo": []}
    engine_s = []
    for it in range(args.iters + 1):  # call 0 is the warm-up
        for name, group, y in (("fasta2a", None, y_fa), ("gloo", gloo, y_gl)):
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x, outs, ins, group=group)
            t = slowest(time.perf_counter() - t0)
            if name == "fasta2a":
                engine_s.append(slowest(pg.stats()["total_s"]))
            if it > 0:
                times[name].append(t)
        if it == 0:
            same = torch.tensor([int(torch.equal(y_fa, y_gl))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN, group=gloo)
            if not same.item():
                raise SystemExit(f"bench_alltoall: {spec}: fasta2a's bytes differ from gloo's")
    fa, gl = statistics.median(times["fasta2a"]), statistics.median(times["gloo"])
    lb = lb_server_s(T)
    row = dict(workload=spec, ranks=n, servers=S, gpus=G, bytes_per_rank_max=max(sum(r) for r in T) * args.row_bytes,
               fasta2a_s=fa, gloo_s=gl, speedup=gl / fa, fasta2a_runs=times["fasta2a"], gloo_runs=times["gloo"],
               engine_s=statistics.median(engine_s[1:]), lb_server_s=lb,
               fasta2a_over_lb=fa / lb if lb else None, gloo_over_lb=gl / lb if lb else None,
               stages=pg.stats().get("stages"), staging_bytes_max=int(slowest(pg.stats().get("staging_bytes", 0))),
               recv_bytes=sum(outs) * args.row_bytes)
    results.append(row)
    if rank == 0:
        lbtxt = f"  x LB {fa / lb:5.2f} / {gl / lb:5.2f}" if lb else ""
        print(f"{spec:>16}  fasta2a {fa * 1e3:9.2f} ms  gloo {gl * 1e3:9.2f} ms  gloo/fasta2a {gl / fa:5.2f}  "
              f"engine's own {row['engine_s'] * 1e3:8.3f} ms{lbtxt}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

dist.barrier(group=gloo)
dist.destroy_process_group()
