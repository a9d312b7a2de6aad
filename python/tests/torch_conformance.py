"""fasta2a_torch against gloo, byte for byte: run by torchrun (tests/CMakeLists.txt starts it).

Every rank makes the default group with the "fasta2a" backend and a gloo group over the same ranks,
then for each case (split pattern x dtype x shape, drawn from fixed seeds) runs the same
all_to_all_single on both and checks that every received byte is equal. gloo refuses bf16 and bool:
their reference runs on uint8 views of the same rows. Also checked: async_op, non-contiguous
tensors, splits as lists, numpy arrays and None, subgroups, all-gathers and barrier, the Group
object (all_to_all_single, dispatch/combine with the kept plan transposed, autograd gradients
against gloo's), and the error cases (split sizes that do not sum, counts that disagree between
ranks: every rank raises and the next call works).

    python3 -m torch.distributed.run --redirects 2 --tee 2 --nproc_per_node 4 torch_conformance.py

Exits 0 when every check passed; rank 0 prints "N passed, 0 failed".
"""

import argparse
import datetime
import os
import random
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

import fasta2a_torch

parser = argparse.ArgumentParser()
parser.add_argument("--cases", type=int, default=24, help="random split patterns (besides the fixed ones)")
parser.add_argument("--seed", type=int, default=20261207)
parser.add_argument("--workloads", default=os.environ.get("FASTA2A_WORKLOADS_DIR", ""))
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("fasta2a", timeout=datetime.timedelta(seconds=60))
rank, n = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "fasta2a"
gloo = dist.new_group(list(range(n)), backend="gloo")

passed = 0
failures = []


def check(cond, what):
    global passed
    if cond:
        passed += 1
    else:
        failures.append(what)
        print(f"rank {rank}: FAILED: {what}", file=sys.stderr, flush=True)


def byte_view(t):
    """The rows of t as uint8 columns (gloo's reference for dtypes it refuses)."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    width = t.element_size()
    for d in t.shape[1:]:
        width *= d
    if t.numel() == 0:  # no rows: the row width still has to match the other ranks'
        return torch.empty((t.shape[0], width), dtype=torch.uint8)
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def random_tensor(rows, tail, dtype, g):
    shape = (rows,) + tail
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape + (2,), generator=g).view(torch.complex64).reshape(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def matrix(pattern, rng):
    """An n x n matrix of rows, T[i][j] = rows rank i sends rank j; the same on every rank."""
    if pattern == "uniform":
        k = rng.randint(1, 9)
        return [[k] * n for _ in range(n)]
    if pattern == "random":
        return [[rng.randint(0, 12) for _ in range(n)] for _ in range(n)]
    if pattern == "zeros":  # a quarter of the pairs send nothing
        return [[0 if rng.random() < 0.25 else rng.randint(1, 9) for _ in range(n)] for _ in range(n)]
    if pattern == "silent-sender":
        s = rng.randrange(n)
        return [[0 if i == s else rng.randint(1, 5) for _ in range(n)] for i in range(n)]
    if pattern == "silent-receiver":
        d = rng.randrange(n)
        return [[0 if j == d else rng.randint(1, 5) for j in range(n)] for _ in range(n)]
    if pattern == "hot-spot":
        h = rng.randrange(n)
        return [[40 if j == h else 2 for j in range(n)] for _ in range(n)]
    if pattern == "zipf":
        w = [1.0 / (k + 1) for k in range(n)]
        perm = list(range(n))
        rng.shuffle(perm)
        return [[int(60 * w[perm[j]]) for j in range(n)] for _ in range(n)]
    if pattern == "self-only":
        return [[5 if i == j else 0 for j in range(n)] for i in range(n)]
    if pattern == "empty":
        return [[0] * n for _ in range(n)]
    if pattern == "megatron":
        return megatron(rng)
    raise ValueError(pattern)


def megatron(rng):
    """One matrix of the Megatron trace (32 x 32 tokens), folded onto n ranks and scaled down."""
    path = os.path.join(args.workloads, "megatron-4n-32gpu.txt")
    if not args.workloads or not os.path.exists(path):
        return None
    k = rng.randrange(600)
    with open(path) as f:
        vals = [int(next(f)) for _ in range((k + 1) * 1024)][k * 1024:]
    m = [[0] * n for _ in range(n)]
    for i in range(32):
        for j in range(32):
            m[i * n // 32][j * n // 32] += vals[i * 32 + j]
    return [[v // 64 for v in row] for row in m]


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
TAILS = [(), (3,), (2, 5), (16,)]


def run_case(name, T, dtype, tail, split_form="list", async_op=False, noncontig=False):
    """One all_to_all_single on both backends, every received byte compared."""
    if os.environ.get("FASTA2A_TEST_VERBOSE"):
        print(f"rank {rank}: {name} {dtype} {tail} {split_form} async={async_op} noncontig={noncontig} T={T}", flush=True)
    g = torch.Generator().manual_seed(hash((args.seed, name, rank)) % (2**31))
    in_splits = T[rank]
    out_splits = [T[i][rank] for i in range(n)]
    x = random_tensor(sum(in_splits), tail, dtype, g)
    if noncontig:  # the same values through a strided view
        big = torch.zeros((x.shape[0] * 2,) + tail, dtype=dtype)
        big[::2] = x
        x = big[::2]
        assert not x.is_contiguous() or x.shape[0] <= 1
    y = torch.full((sum(out_splits),) + tail, 7, dtype=dtype) if dtype != torch.bool else torch.zeros((sum(out_splits),) + tail, dtype=dtype)
    if noncontig and y.dim() >= 2 and y.shape[0] > 1:
        y = y.transpose(0, 1).contiguous().transpose(0, 1)
    if split_form == "numpy":
        ins, outs = np.array(in_splits, dtype=np.int64), np.array(out_splits, dtype=np.int64)
    elif split_form == "none":
        ins, outs = None, None
    else:
        ins, outs = list(in_splits), list(out_splits)
    work = dist.all_to_all_single(y, x, outs, ins, async_op=async_op)
    if async_op:
        check(work is not None, f"{name}: async_op returns a Work")
        work.wait()
        check(work.is_completed(), f"{name}: the Work is completed after wait()")
    ref_dtype_ok = dtype not in (torch.bfloat16, torch.bool)
    xr = x.contiguous() if ref_dtype_ok else byte_view(x)
    yr = torch.empty((sum(out_splits),) + tuple(xr.shape[1:]), dtype=xr.dtype)
    dist.all_to_all_single(yr, xr, list(out_splits), list(in_splits), group=gloo)
    got = y.contiguous() if ref_dtype_ok else byte_view(y)
    check(got.shape == yr.shape and torch.equal(byte_view(got), byte_view(yr)),
          f"{name}: {dtype} {tuple(tail)} received bytes differ from gloo's")


def fixed_and_random_cases():
    rng = random.Random(args.seed)
    patterns = ["uniform", "random", "zeros", "silent-sender", "silent-receiver", "hot-spot", "zipf", "self-only",
                "empty", "megatron"]
    cases = []
    for p in patterns:
        cases.append(p)
    for _ in range(args.cases):
        cases.append(rng.choice(patterns))
    done = 0
    for k, p in enumerate(cases):
        T = matrix(p, rng)
        if T is None:
            continue
        dtype = DTYPES[k % len(DTYPES)]
        tail = TAILS[(k // len(DTYPES) + k) % len(TAILS)]
        form = ["list", "numpy", "list", "list"][k % 4]
        run_case(f"case {k} ({p})", T, dtype, tail, split_form=form, async_op=(k % 5 == 3), noncontig=(k % 7 == 2))
        done += 1
    # Equal splits (None) on every dtype.
    for dtype in DTYPES:
        run_case(f"equal splits {dtype}", [[3] * n for _ in range(n)], dtype, (4,), split_form="none")
        done += 1
    # Large calls: 1 MiB per rank pair, Zipf rows of 4 KiB.
    T = matrix("zipf", rng)
    run_case("large zipf", [[v * 16 for v in row] for row in T], torch.float32, (1024,))
    return done + 1


def two_async_in_flight():
    a = torch.arange(n * 2, dtype=torch.int64) + 1000 * rank
    b = torch.arange(n * 3, dtype=torch.int64) - 1000 * rank
    ya, yb = torch.empty_like(a), torch.empty_like(b)
    wa = dist.all_to_all_single(ya, a, async_op=True)
    wb = dist.all_to_all_single(yb, b, async_op=True)
    wb.wait()
    wa.wait()
    ra, rb = torch.empty_like(a), torch.empty_like(b)
    dist.all_to_all_single(ra, a, group=gloo)
    dist.all_to_all_single(rb, b, group=gloo)
    check(torch.equal(ya, ra) and torch.equal(yb, rb), "two async calls in flight, waited out of order")
    fut = dist.all_to_all_single(ya, a, async_op=True).get_future()
    check(torch.equal(fut.wait()[0], ra), "a Work's future yields the output")


def gathers_and_barrier():
    t = torch.tensor([rank * 10 + 1, rank], dtype=torch.int64)
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(outs, t)
    check(all(outs[r].tolist() == [r * 10 + 1, r] for r in range(n)), "all_gather")
    flat = torch.empty(2 * n, dtype=torch.float64)
    dist.distributed_c10d._all_gather_base(flat, t.double())
    check(flat.view(n, 2)[:, 1].tolist() == [float(r) for r in range(n)], "_all_gather_base")
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "name": "r" * (rank + 1)})
    check(objs == [{"rank": r, "name": "r" * (r + 1)} for r in range(n)], "all_gather_object")
    dist.barrier()
    x = torch.ones(3) * (rank + 1)
    dist.all_reduce(x)  # delegated to gloo
    check(x.tolist() == [n * (n + 1) / 2] * 3, "all_reduce (delegated to gloo)")
    b = torch.tensor([rank])
    dist.broadcast(b, src=n - 1)
    check(b.item() == n - 1, "broadcast (delegated to gloo)")


def subgroups():
    """Groups of part of the world: the first half (2 servers of n/4 ranks with G = n/2... as the
    topology says) and the even ranks."""
    halves = [list(range(n // 2)), list(range(n // 2, n))]
    evens = list(range(0, n, 2))
    made = 0
    for ranks in halves + [evens]:
        try:
            sub = dist.new_group(ranks, backend="fasta2a")
        except ValueError as e:  # a topology the group cannot have: every rank raises alike
            check("server" in str(e), f"subgroup {ranks} refused with a reason: {e}")
            continue
        subg = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            m = len(ranks)
            me = ranks.index(rank)
            rng = random.Random(args.seed + m)
            T = [[rng.randint(0, 6) for _ in range(m)] for _ in range(m)]
            x = torch.randn(sum(T[me]), 5, generator=torch.Generator().manual_seed(rank))
            y = torch.empty(sum(T[i][me] for i in range(m)), 5)
            yr = torch.empty_like(y)
            dist.all_to_all_single(y, x, [T[i][me] for i in range(m)], T[me], group=sub)
            dist.all_to_all_single(yr, x, [T[i][me] for i in range(m)], T[me], group=subg)
            check(torch.equal(y, yr), f"subgroup {ranks}: bytes equal to gloo's")
            made += 1
    return made


class GlooAllToAll(torch.autograd.Function):
    """The reference: gloo's all_to_all_single, with the reverse call as its gradient."""

    @staticmethod
    def forward(ctx, x, ins, outs):
        ctx.ins, ctx.outs = ins, outs
        y = x.new_empty((sum(outs),) + tuple(x.shape[1:]))
        dist.all_to_all_single(y, x.contiguous(), list(outs), list(ins), group=gloo)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = dy.new_empty((sum(ctx.ins),) + tuple(dy.shape[1:]))
        dist.all_to_all_single(dx, dy.contiguous(), list(ctx.ins), list(ctx.outs), group=gloo)
        return dx, None, None


def group_object():
    grp = fasta2a_torch.Group(plans_kept=2)
    rng = random.Random(args.seed + 99)
    for layer in range(3):
        T = [[rng.randint(0, 9) for _ in range(n)] for _ in range(n)]
        g = torch.Generator().manual_seed(rank * 100 + layer)
        x0 = torch.randn(sum(T[rank]), 8, generator=g, dtype=torch.float64)
        w = torch.randn(8, 8, generator=g, dtype=torch.float64)
        # fasta2a: dispatch, a per-rank function, combine; gradients of x and w.
        x = x0.clone().requires_grad_()
        wf = w.clone().requires_grad_()
        y, h = grp.dispatch(x, T[rank])
        check(list(h.out_splits) == [T[i][rank] for i in range(n)], f"layer {layer}: dispatch's received splits")
        check(grp.stats()["plan_from"] in ("planned", "same", "transposed"), "stats report where the plan came from")
        z = grp.combine(torch.tanh(y @ wf), h)
        check(grp.stats()["plan_from"] == "transposed", f"layer {layer}: the combine ran the dispatch's plan transposed")
        loss = (z * z).sum()
        loss.backward()
        # gloo reference.
        xr = x0.clone().requires_grad_()
        wr = w.clone().requires_grad_()
        outs = [T[i][rank] for i in range(n)]
        yr = GlooAllToAll.apply(xr, T[rank], outs)
        zr = GlooAllToAll.apply(torch.tanh(yr @ wr), outs, T[rank])
        (zr * zr).sum().backward()
        check(torch.equal(z, zr), f"layer {layer}: combine's output equals gloo's")
        check(torch.equal(x.grad, xr.grad), f"layer {layer}: dispatch's input gradient equals gloo's")
        check(torch.equal(wf.grad, wr.grad), f"layer {layer}: the expert weight's gradient equals gloo's")
    # Group.all_to_all_single with equal splits.
    a = torch.arange(n * 4, dtype=torch.int32) + rank * 1000
    y, r = torch.empty_like(a), torch.empty_like(a)
    grp.all_to_all_single(y, a)
    dist.all_to_all_single(r, a, group=gloo)
    check(torch.equal(y, r), "Group.all_to_all_single with equal splits")
    grp.barrier()


def errors():
    x = torch.zeros(n * 2)
    y = torch.zeros(n * 2)
    # Split sizes that do not sum to the first dimension: ValueError here, before anything moves.
    try:
        dist.all_to_all_single(y, x, [2] * n, [3] * n)
        check(False, "splits summing past the input raise ValueError")
    except ValueError as e:
        check("split sizes" in str(e), f"ValueError names the split sizes: {e}")
    # Only rank 0's splits are bad: rank 0 gets ValueError, every other rank a RuntimeError naming it.
    bad = [1] * n if rank == 0 else [2] * n
    t0 = time.monotonic()
    try:
        dist.all_to_all_single(y, x, [2] * n, bad)
        check(False, "one rank's bad splits fail every rank")
    except ValueError as e:
        check(rank == 0, f"rank {rank} raised ValueError for rank 0's splits: {e}")
    except RuntimeError as e:
        check(rank != 0 and "rank 0" in str(e), f"rank {rank}: the error names rank 0: {e}")
    check(time.monotonic() - t0 < 10, "a refused call fails at once, not at the timeout")
    # Counts that disagree between ranks: rank 1 expects one row more from rank 0 than rank 0 sends.
    outs = [2] * n
    ins = [2] * n
    y2 = torch.zeros(n * 2 + (1 if rank == 1 else 0))
    if rank == 1:
        outs[0] = 3
    try:
        dist.all_to_all_single(y2, x, outs, ins)
        check(False, "counts that disagree raise on every rank")
    except ValueError as e:
        check(False, f"disagreeing counts are a RuntimeError, not ValueError: {e}")
    except RuntimeError as e:
        check("rank 1" in str(e), f"rank {rank}: the error names rank 1: {e}")
    # The next call works.
    a = torch.arange(n * 2, dtype=torch.float32) + rank
    b, c = torch.empty_like(a), torch.empty_like(a)
    dist.all_to_all_single(b, a)
    dist.all_to_all_single(c, a, group=gloo)
    check(torch.equal(b, c), "the call after a failed one moves every byte")
    # dtype and device mismatches.
    try:
        dist.all_to_all_single(torch.zeros(n, dtype=torch.int32), torch.zeros(n))
        check(False, "a dtype mismatch raises")
    except (ValueError, RuntimeError) as e:
        check("dtype" in str(e).lower() or "type" in str(e).lower(), f"a dtype mismatch names the types: {e}")
    dist.barrier()


sections = [("split patterns", fixed_and_random_cases), ("async", two_async_in_flight),
            ("gathers", gathers_and_barrier), ("subgroups", subgroups), ("Group", group_object),
            ("errors", errors)]
for name, fn in sections:
    try:
        fn()
    except Exception:  # a crash of one section is a failure, and the others still run
        failures.append(f"{name}: {traceback.format_exc()}")
        print(f"rank {rank}: section {name} crashed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        break

counts = [None] * n
dist.all_gather_object(counts, (passed, len(failures)), group=gloo)
if rank == 0:
    print(f"fasta2a_torch conformance, {n} ranks, "
          f"{os.environ.get('FASTA2A_GPUS_PER_SERVER') or os.environ.get('LOCAL_WORLD_SIZE')} per server: "
          f"{sum(c[0] for c in counts)} checks passed on all ranks, {sum(c[1] for c in counts)} failed")
    print(f"{sum(c[0] for c in counts)} passed, {sum(c[1] for c in counts)} failed", flush=True)
ok = all(c[1] == 0 for c in counts)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
