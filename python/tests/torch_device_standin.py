"""fasta2a_torch.DeviceGroup on the project's stand-in of the GPU runtime, against gloo: run by torchrun.

Each rank allocates stand-in device buffers, and per seed queues on ONE stream of its own: the
copies of its send bytes to the device, three all-to-alls (the second into the receive buffer of the
first, after the first's bytes were copied out in stream order, so a peer that writes too early is
caught), and the copies of what arrived back to the host; only then does it wait for the stream.
The stand-in delays each stream operation at random (0 to 400 us), which is what exposes work
ordered on the wrong stream. Every received byte is compared with gloo's all_to_all_single of the
same data. These are checks of ordering and bookkeeping, never timings.

    python3 -m torch.distributed.run ... --nproc_per_node 4 torch_device_standin.py --seeds 6
"""

import argparse
import datetime
import random
import sys

import torch
import torch.distributed as dist

import fasta2a_torch
from fasta2a_torch import _device_standin as rt

parser = argparse.ArgumentParser()
parser.add_argument("--seeds", type=int, default=6)
parser.add_argument("--max-delay-us", type=int, default=400)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, n = dist.get_rank(), dist.get_world_size()
rt.set_standin_delays(args.max_delay_us, 7919 + rank)
grp = fasta2a_torch.DeviceGroup(runtime="standin", timeout=datetime.timedelta(seconds=30))
wrong = 0
checked = 0
stream = rt.Stream()


def host_bytes(k, g):
    return torch.randint(0, 256, (k,), generator=g, dtype=torch.int64).to(torch.uint8)


for seed in range(1, args.seeds + 1):
    rng = random.Random(seed)
    mats = []
    for _ in range(2):  # skewed: a hot receiver, some empty pairs
        hot = rng.randrange(n)
        mats.append([[0 if rng.random() < 0.2 else rng.randint(1, 3000) * (8 if j == hot else 1) for j in range(n)]
                     for _ in range(n)])
    g = torch.Generator().manual_seed(seed * 100 + rank)
    sends = [host_bytes(sum(T[rank]), g) for T in mats]
    recv_sizes = [sum(T[i][rank] for i in range(n)) for T in mats]
    dev_send = [rt.DeviceBuffer(max(1, s.numel())) for s in sends]
    R = rt.DeviceBuffer(max(1, max(recv_sizes)))
    R3 = rt.DeviceBuffer(max(1, recv_sizes[0]))
    got = [torch.zeros(max(1, recv_sizes[0]), dtype=torch.uint8), torch.zeros(max(1, recv_sizes[1]), dtype=torch.uint8),
           torch.zeros(max(1, recv_sizes[0]), dtype=torch.uint8)]
    canary = torch.full((max(1, max(recv_sizes)),), 0xA5, dtype=torch.uint8)
    h = stream.handle
    for s, d in zip(sends, dev_send):
        if s.numel():
            rt.memcpy_async(d.ptr, s.data_ptr(), s.numel(), h)
    rt.memcpy_async(R.ptr, canary.data_ptr(), R.size, h)
    outs = [[T[i][rank] for i in range(n)] for T in mats]
    grp.all_to_all_bytes(R.ptr, recv_sizes[0], dev_send[0].ptr, sends[0].numel(), outs[0], mats[0][rank], h)
    rt.memcpy_async(got[0].data_ptr(), R.ptr, recv_sizes[0], h)
    rt.memcpy_async(R.ptr, canary.data_ptr(), R.size, h)
    grp.all_to_all_bytes(R.ptr, recv_sizes[1], dev_send[1].ptr, sends[1].numel(), outs[1], mats[1][rank], h)
    rt.memcpy_async(got[1].data_ptr(), R.ptr, recv_sizes[1], h)
    grp.all_to_all_bytes(R3.ptr, recv_sizes[0], dev_send[0].ptr, sends[0].numel(), outs[0], mats[0][rank], h)
    rt.memcpy_async(got[2].data_ptr(), R3.ptr, recv_sizes[0], h)
    stream.synchronize()
    grp.synchronize()
    for k, (T, mi) in enumerate(((mats[0], 0), (mats[1], 1), (mats[0], 0))):
        ref = torch.empty(recv_sizes[mi], dtype=torch.uint8)
        dist.all_to_all_single(ref, sends[mi], outs[mi], T[rank])
        bad = int((got[k][:recv_sizes[mi]] != ref).sum())
        if bad:
            where = (got[k][:recv_sizes[mi]] != ref).nonzero().flatten()
            print(f"rank {rank}: seed {seed} call {k + 1}: {bad} of {recv_sizes[mi]} bytes wrong, the first at "
                  f"{int(where[0])} (splits in {[T[i][rank] for i in range(n)]})", flush=True)
        wrong += bad
        checked += recv_sizes[mi]
    dist.barrier()  # every rank is done with every peer's buffers before they are freed
    for b in dev_send + [R, R3]:  # their addresses may come back in the next seed's buffers
        grp.forget(b.ptr)

totals = torch.tensor([wrong, checked], dtype=torch.int64)
dist.all_reduce(totals)
if rank == 0:
    print(f"fasta2a_torch.DeviceGroup on the {rt.runtime}: {n} ranks, {args.seeds} seeds, {int(totals[1])} bytes "
          f"checked, {int(totals[0])} wrong ({grp.describe()})", flush=True)
ok = int(totals[0]) == 0
print(f"{1 if ok else 0} passed, {0 if ok else 1} failed", flush=True) if rank == 0 else None
dist.barrier()
sys.exit(0 if ok else 1)
