"""A small mixture-of-experts language model trained with expert parallelism over torch.distributed.

The model: token embedding -> L blocks -> layer norm -> vocabulary head, trained on next-token
prediction. Each block is a cheap causal token mixer (a prefix mean through a linear layer) and an
MoE layer: a router picks k = 2 of E experts per token (softmax over the two chosen logits), the
token copies are sorted by expert and sent to the experts' ranks with ``all_to_all_single``
(row counts exchanged first, as Megatron's token dispatcher does), each rank runs its experts
(d -> 4d -> d, GELU) and sends the results back with the reverse all-to-all, and the copies are
un-sorted and summed with their gate weights into the residual stream. E = experts_per_rank x world
size; expert e lives on rank e // experts_per_rank. There is no capacity limit (no token is
dropped), so the splits are uneven, and a fixed router bias of -zipf * log(e + 1) makes a few
experts hot, as routing in trained MoE models is. The data is a fixed random Markov "language"
(the same on every rank), each rank sampling its own shard.

Both all-to-all directions are ``dist.all_to_all_single`` calls, so the same code runs on gloo and
on fasta2a: with the same seed the loss trajectory is identical bit for bit, because fasta2a only
moves bytes and every other collective (the gradient all-reduce) is gloo in both.

One machine, 4 ranks (Debian's torchrun needs ``--redirects 2 --tee 2`` on Python 3.11; build
fasta2a with cmake first, its Python package lands in BUILD/python):

    PYTHONPATH=BUILD/python /usr/bin/python3 -m torch.distributed.run --redirects 2 --tee 2 \\
        --nproc_per_node 4 examples/torch/moe_train.py --backend fasta2a --steps 50

``--backend gloo`` runs the same training without fasta2a (no build needed); ``--losses FILE`` on
both and ``cmp`` shows they agree. fasta2a takes the ranks per server from LOCAL_WORLD_SIZE, or
``FASTA2A_GPUS_PER_SERVER=2`` to pretend 8 local ranks are 4 servers of 2.

The emulated cluster (examples/cluster/cluster.sh up S G RATE): one torchrun per emulated server,
in that server's namespace, with rank 0's NIC (10.77.1.1) as the master, every rank on its own NIC
(emulated_cluster.py: FASTA2A_NIC_PATTERN names it from LOCAL_RANK; the preloaded bind_source
library binds the sockets gloo connects from to it):

    examples/cluster/cluster.sh up 4 4 200
    for k in 0 1 2 3; do
      ip netns exec fa2a-srv$k env PYTHONPATH=BUILD/python FASTA2A_NIC_PATTERN='nic{local_rank}' \
          LD_PRELOAD=BUILD/examples/cluster/libfasta2a_bind_source.so \
          /usr/bin/python3 -m torch.distributed.run --redirects 2 --tee 2 --nnodes 4 --node_rank $k \
          --nproc_per_node 4 --master_addr 10.77.1.1 --master_port 29500 \
          examples/torch/moe_train.py --backend fasta2a &
    done; wait
    examples/cluster/cluster.sh down

``cluster.sh launch -- env PYTHONPATH=BUILD/python /usr/bin/python3 examples/torch/moe_train.py``
starts the ranks itself instead, with torchrun's variables and FASTA2A_NIC.

Reported on rank 0 at the end: the backend, world size, steps, the median step time and the
median time inside all-to-all calls per step (counts exchange, dispatch and combine, forward and
backward), both the slowest rank's per step, the all-to-all's share of the step, tokens per second
(all ranks' tokens over the median step), the expert load and the final loss (mean over ranks).
An all-to-all's time includes waiting for the last rank to arrive: the rank of the hot experts
computes longest, so on a machine with fewer cores than ranks much of that time is waiting.
``--json FILE`` writes the same as JSON, ``--losses FILE`` one loss per step as float.hex().
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from emulated_cluster import pin_to_nic

A2A_SECONDS = [0.0]  # time inside all_to_all_single calls, reset every step


def exchange(x, out_splits, in_splits, group):
    """Rows of x to ranks by in_splits; returns the rows received, out_splits[r] from rank r."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)  # blocking: no async_op
    A2A_SECONDS[0] += time.perf_counter() - t0
    return out


class AllToAll(torch.autograd.Function):
    """The gradient of an all-to-all is the all-to-all of the gradient, back where the rows came from."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        return exchange(dy, in_splits, out_splits, ctx.group), None, None, None


class MoE(nn.Module):
    def __init__(self, d, world, rank, experts_per_rank, zipf, seed, layer, group):
        super().__init__()
        self.world, self.epr, self.group = world, experts_per_rank, group
        self.num_experts = experts_per_rank * world
        self.router = nn.Linear(d, self.num_experts, bias=False)
        e = torch.arange(self.num_experts, dtype=torch.float32)
        self.register_buffer("zipf_bias", -zipf * torch.log(e + 1.0))
        # The local experts as stacked weights (one grouped GEMM's layout). Each is drawn from a
        # generator seeded by its global index, so expert e has the same weights whichever rank
        # holds it and whatever the backend, and the global RNG (replicated params) is not touched.
        h = 4 * d
        self.w1 = nn.Parameter(torch.empty(experts_per_rank, d, h))
        self.b1 = nn.Parameter(torch.zeros(experts_per_rank, h))
        self.w2 = nn.Parameter(torch.empty(experts_per_rank, h, d))
        self.b2 = nn.Parameter(torch.zeros(experts_per_rank, d))
        with torch.no_grad():
            for j in range(experts_per_rank):
                g = torch.Generator().manual_seed(seed * 100003 + layer * 1009 + rank * experts_per_rank + j + 1)
                self.w1[j].uniform_(-1 / math.sqrt(d), 1 / math.sqrt(d), generator=g)
                self.w2[j].uniform_(-1 / math.sqrt(h), 1 / math.sqrt(h), generator=g)
        self.load = torch.zeros(self.num_experts, dtype=torch.int64)  # token copies routed, this rank

    def forward(self, x, k=2):
        T, d = x.shape
        logits = self.router(x) + self.zipf_bias
        top, idx = logits.topk(k, dim=-1)
        gates = F.softmax(top, dim=-1)
        # Switch's load-balancing term: fraction routed times mean router probability, per expert.
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.load += counts
        aux = self.num_experts * (counts.float() / flat.numel() * F.softmax(logits, -1).mean(0)).sum()

        # Permute: copies sorted by expert are also sorted by destination rank, and within a rank
        # by its local expert, which is the order the receiver wants them in.
        order = torch.sort(flat, stable=True)[1]
        sent = x[torch.div(order, k, rounding_mode="floor")]
        in_splits = counts.view(self.world, self.epr).sum(1).tolist()
        # Counts per expert, not per rank: the receiver needs to know how its rows split by expert.
        recv_counts = torch.empty_like(counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        A2A_SECONDS[0] += time.perf_counter() - t0
        recv_counts = recv_counts.view(self.world, self.epr)  # [source rank, local expert]
        out_splits = recv_counts.sum(1).tolist()

        recv = AllToAll.apply(sent, out_splits, in_splits, self.group)
        # Rows arrive by source rank, then local expert; group them by local expert.
        local_e = torch.arange(self.epr).repeat(self.world).repeat_interleave(recv_counts.reshape(-1))
        by_expert = torch.sort(local_e, stable=True)[1]
        grouped = recv[by_expert]
        outs = []
        for j, rows in enumerate(grouped.split(recv_counts.sum(0).tolist())):
            hdn = F.gelu(rows @ self.w1[j] + self.b1[j])
            outs.append(hdn @ self.w2[j] + self.b2[j])
        done = torch.empty_like(grouped).index_copy(0, by_expert, torch.cat(outs))  # back to arrival order
        back = AllToAll.apply(done, in_splits, out_splits, self.group)

        # Un-permute to (token, slot) order and weigh each copy by its gate.
        copies = torch.empty_like(back).index_copy(0, order, back).view(T, k, d)
        return (copies * gates.unsqueeze(-1)).sum(1), aux


class Block(nn.Module):
    def __init__(self, d, moe):
        super().__init__()
        self.ln1, self.mix, self.ln2, self.moe = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d), moe

    def forward(self, x):  # x: [sequences, length, d]
        B, S, d = x.shape
        # Causal and cheap: each position sees the mean of itself and what came before.
        h = self.ln1(x).cumsum(1) / torch.arange(1, S + 1, dtype=x.dtype).view(1, S, 1)
        x = x + self.mix(h)
        y, aux = self.moe(self.ln2(x).reshape(B * S, d))
        return x + y.view(B, S, d), aux


class MoELM(nn.Module):
    def __init__(self, args, world, rank, group):
        super().__init__()
        d = args.d_model
        self.embed = nn.Embedding(args.vocab, d)
        self.blocks = nn.ModuleList(
            Block(d, MoE(d, world, rank, args.experts_per_rank, args.zipf, args.seed, i, group))
            for i in range(args.layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, args.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return self.head(self.ln(x)), aux / len(self.blocks)


class Language:
    """A fixed random Markov chain: every token has 4 likely successors, plus 10% uniform noise, so
    the loss can fall well below log(vocab) but not to zero."""

    def __init__(self, vocab, seed):
        g = torch.Generator().manual_seed(seed + 7919)  # the same language on every rank
        self.vocab = vocab
        self.succ = torch.randint(vocab, (vocab, 4), generator=g)
        self.succ_p = torch.tensor([0.5, 0.25, 0.15, 0.1])
        self.unigram = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)  # Zipf first tokens

    def sample(self, sequences, length, g):
        tok = torch.empty(sequences, length + 1, dtype=torch.int64)
        tok[:, 0] = torch.multinomial(self.unigram, sequences, replacement=True, generator=g)
        for t in range(length):
            pick = torch.multinomial(self.succ_p, sequences, replacement=True, generator=g)
            nxt = self.succ[tok[:, t], pick]
            noise = torch.rand(sequences, generator=g) < 0.1
            tok[:, t + 1] = torch.where(noise, torch.randint(self.vocab, (sequences,), generator=g), nxt)
        return tok[:, :-1], tok[:, 1:]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["fasta2a", "gloo"], default="fasta2a")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.0, help="router bias -zipf*log(e+1): hot experts")
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--losses", help="rank 0 writes each step's loss (mean over ranks) as float.hex()")
    p.add_argument("--json", help="rank 0 writes the summary as JSON")
    p.add_argument("--timeout", type=float, default=120, help="seconds any collective may wait")
    a = p.parse_args()
    if a.batch % a.seq_len:
        p.error(f"--batch {a.batch} is not a multiple of --seq-len {a.seq_len}")
    return a


def main():
    args = parse()
    pin_to_nic()  # on the emulated cluster: this rank's NIC for fasta2a and gloo alike
    torch.set_num_threads(1)  # reproducible reductions, and ranks sharing few cores do not fight
    if args.backend == "fasta2a":
        try:
            import fasta2a_torch  # noqa: F401  (registers the "fasta2a" backend)
        except ImportError as e:
            sys.exit(f"moe_train: cannot import fasta2a_torch ({e}). Build fasta2a with cmake (python3-torch, "
                     f"libtorch-dev and pybind11-dev installed) and put BUILD/python on PYTHONPATH, "
                     f"or run with --backend gloo.")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_group = dist.group.WORLD  # expert parallelism over every rank; data parallelism too

    torch.manual_seed(args.seed)  # the same on every rank: replicated parameters start equal
    model = MoELM(args, world, rank, ep_group)
    expert = [p for n, p in model.named_parameters() if n.split(".")[-1] in ("w1", "b1", "w2", "b2")]
    expert_ids = {id(p) for p in expert}
    replicated = [p for p in model.parameters() if id(p) not in expert_ids]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    lang = Language(args.vocab, args.seed)
    data = torch.Generator().manual_seed(args.seed + rank)  # this rank's shard
    seqs = args.batch // args.seq_len

    losses, step_s, a2a_s = [], [], []
    for step in range(args.steps):
        inputs, targets = lang.sample(seqs, args.seq_len, data)
        A2A_SECONDS[0] = 0.0
        t0 = time.perf_counter()
        logits, aux = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=False)
        (loss + args.aux_coef * aux).backward()
        # Replicated grads averaged over ranks, with the loss riding along in the same all-reduce.
        flat = torch.cat([p.grad.reshape(-1) for p in replicated] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in replicated:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        # An expert's grad already sums every rank's loss (the backward all-to-all brought it
        # home); over world it is the gradient of the mean loss, like the replicated ones.
        for p in expert:
            p.grad /= world
        opt.step()
        step_s.append(time.perf_counter() - t0)
        a2a_s.append(A2A_SECONDS[0])
        losses.append(flat[-1].item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  step {step_s[-1] * 1e3:7.2f} ms  "
                  f"all-to-all {a2a_s[-1] * 1e3:7.2f} ms (rank 0)", flush=True)

    # After the loop, so that it costs no step anything: each step's slowest rank.
    times = torch.tensor([step_s, a2a_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    load = torch.stack([b.moe.load for b in model.blocks])
    dist.all_reduce(load)
    timed = slice(args.warmup, None) if args.steps > args.warmup else slice(None)
    step_med = statistics.median(times[0, timed].tolist())
    a2a_med = statistics.median(times[1, timed].tolist())
    summary = dict(
        backend=args.backend, world_size=world, steps=args.steps, warmup=args.warmup,
        timing="slowest rank per step, median over the steps after the warm-up",
        tokens_per_step=args.batch * world, step_ms_median=step_med * 1e3,
        tokens_per_s=args.batch * world / step_med, a2a_ms_median=a2a_med * 1e3,
        a2a_share=a2a_med / step_med, a2a_calls_per_step=5 * args.layers,
        expert_load_layer0=load[0].tolist(), final_loss=losses[-1],
        losses_hex=[float(x).hex() for x in losses])
    if rank == 0:
        share = load[0].double() / load[0].sum()
        n_timed = len(times[0, timed])
        print(f"moe_train: backend {args.backend}, {world} ranks, {args.steps} steps ({n_timed} timed), "
              f"{args.batch} tokens per rank per step, {model.blocks[0].moe.num_experts} experts, top-2\n"
              f"  step time      {step_med * 1e3:9.2f} ms median (slowest rank per step)\n"
              f"  throughput     {summary['tokens_per_s']:9.0f} tokens/s (all ranks)\n"
              f"  all-to-all     {a2a_med * 1e3:9.2f} ms median per step, {100 * a2a_med / step_med:.1f}% of the "
              f"step ({5 * args.layers} calls: counts, dispatch, combine forward; combine, dispatch backward)\n"
              f"  expert load    layer 0: {' '.join(f'{100 * s:.1f}%' for s in share.tolist())}\n"
              f"  loss           {losses[0]:.4f} -> {losses[-1]:.4f} (final, mean over ranks)", flush=True)
        if args.losses:
            with open(args.losses, "w") as f:
                f.writelines(float(x).hex() + "\n" for x in losses)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
                f.write("\n")
    dist.barrier()  # no rank leaves while another still needs it for a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
