"""fasta2a for PyTorch: the FAST all-to-allv as a torch.distributed backend and a Group object.

``import fasta2a_torch`` registers the c10d backend ``"fasta2a"``::

    import torch.distributed as dist
    import fasta2a_torch  # noqa: F401  (registers the backend)

    dist.init_process_group("fasta2a")                       # or dist.new_group(ranks, backend="fasta2a")
    dist.all_to_all_single(out, inp, out_splits, in_splits)  # Megatron's call shape, unchanged

``all_to_all_single`` (uneven, equal and zero splits, every dtype, ``async_op``), ``all_gather``,
``all_gather_into_tensor`` / ``_all_gather_base``, ``all_gather_object`` and ``barrier`` run on
fasta2a's engine and bootstrap; every other collective is delegated to a gloo group made from the
same store (``FASTA2A_INNER_BACKEND=nccl`` picks NCCL in a CUDA build of torch), so ``"fasta2a"``
can be a training script's default backend.

For runtimes that own their buffers, :class:`Group` holds one engine per expert-parallel group,
with ``dispatch``/``combine`` (the combine runs the dispatch's plan transposed) and autograd.

Topology: ranks are server-major (torchrun numbers a node's ranks contiguously). The GPUs per
server come from ``FASTA2A_GPUS_PER_SERVER``, else ``LOCAL_WORLD_SIZE``; a group whose ranks do not
form S servers x G ranks, each server's ranks contiguous, is refused when it is made.

Environment (all optional): ``FASTA2A_DECOMPOSER`` (default ``birkhoff``), ``FASTA2A_PLANS_KEPT``
(default 1), ``FASTA2A_STAGING_FRACTION`` (staging per rank as a fraction of the call's largest
buffer; default 0: no budget, staging as the plan lays it out), ``FASTA2A_SCALEOUT_PROVIDER`` and ``FASTA2A_SCALEUP_PROVIDER`` (libfabric providers;
``FASTA2A_FI_PROVIDER`` sets both; default one ``tcp;ofi_rxm`` endpoint for both tiers), ``FASTA2A_BOOTSTRAP_HOST`` (the address rank 0 publishes for
fasta2a's bootstrap; default: its address on the route to ``MASTER_ADDR``).
"""

from __future__ import annotations

import datetime
import os
import warnings
import socket
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C

__all__ = ["Group", "DeviceGroup", "Handle", "topology_of", "BACKEND"]

BACKEND = "fasta2a"
TimeoutError = _C.TimeoutError  # noqa: A001 (fasta2a's timeout, a RuntimeError)


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        x = int(v)
    except ValueError:
        raise ValueError(f"fasta2a: {name}={v!r} is not an integer") from None
    if x < 1:
        raise ValueError(f"fasta2a: {name}={v!r} must be at least 1")
    return x


def topology_of(global_ranks: Sequence[int], world_size: int) -> Tuple[int, int]:
    """(servers, ranks per server) of a group whose members are ``global_ranks`` in group order.

    A server is ``FASTA2A_GPUS_PER_SERVER`` (else ``LOCAL_WORLD_SIZE``, else the whole world)
    consecutive global ranks. Raises ValueError naming the ranks where the group is not server-major
    with the same number of ranks on every server it touches.
    """
    g_world = _env_int("FASTA2A_GPUS_PER_SERVER", None)
    source = "FASTA2A_GPUS_PER_SERVER"
    if g_world is None:
        g_world = _env_int("LOCAL_WORLD_SIZE", world_size)
        source = "LOCAL_WORLD_SIZE" if os.environ.get("LOCAL_WORLD_SIZE") else "the world size"
    if world_size % g_world != 0:
        raise ValueError(
            f"fasta2a: a world of {world_size} ranks is not a whole number of servers of {g_world} ranks "
            f"({source}); set FASTA2A_GPUS_PER_SERVER")
    ranks = list(global_ranks)
    servers: List[int] = []
    counts: List[int] = []
    for i, r in enumerate(ranks):
        s = r // g_world
        if servers and s == servers[-1]:
            if r <= ranks[i - 1]:
                raise ValueError(f"fasta2a: ranks {ranks[i - 1]} and {r} of server {s} are out of order in the group "
                                 f"{ranks}: a group's ranks must be server-major")
            counts[-1] += 1
        else:
            if s in servers:
                raise ValueError(f"fasta2a: the ranks of server {s} ({g_world} ranks per server, {source}) are not "
                                 f"contiguous in the group {ranks}: rank {r} comes after ranks of server {servers[-1]}")
            servers.append(s)
            counts.append(1)
    if len(set(counts)) != 1:
        detail = ", ".join(f"server {s}: {c}" for s, c in zip(servers, counts))
        raise ValueError(f"fasta2a: the group {ranks} has different numbers of ranks on its servers ({detail}); "
                         f"every server must hold the same number")
    return len(servers), counts[0]


def _root_host() -> str:
    host = os.environ.get("FASTA2A_BOOTSTRAP_HOST")
    if host:
        return host
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:  # the address this host uses towards the job's store: reachable by the job's ranks
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


def _providers() -> Tuple[str, str]:
    """(scale-up, scale-out) libfabric providers; a scale-up of "" shares the scale-out endpoint.

    The default is one tcp;ofi_rxm endpoint for both tiers, chosen by measurement: on one host
    (4 ranks, 4 MiB per rank) libfabric 1.17's shm provider took 11-35 ms per call where tcp over
    loopback took 3.8 ms (docs/TORCH.md).
    """
    both = os.environ.get("FASTA2A_FI_PROVIDER", "")
    out = os.environ.get("FASTA2A_SCALEOUT_PROVIDER", both)
    up = os.environ.get("FASTA2A_SCALEUP_PROVIDER", both)
    return up, out


def _make(store, rank: int, size: int, global_ranks: Sequence[int], timeout: datetime.timedelta,
          decomposer: Optional[str], plans_kept: Optional[int], inner=None):
    world = dist.get_world_size() if dist.is_initialized() else size
    if not global_ranks:
        global_ranks = list(range(size))
    servers, gpus = topology_of(global_ranks, max(world, max(global_ranks) + 1))
    dec = decomposer or os.environ.get("FASTA2A_DECOMPOSER", "birkhoff")
    kept = plans_kept or _env_int("FASTA2A_PLANS_KEPT", 1)
    up, out = _providers()
    # No staging budget by default: on the emulated cluster large calls ran 10-15% faster without
    # one (Zipf(1.0) at 16 MiB per rank 1.05 x LB_server against 1.14), for more staging (113 MiB
    # per rank on the Megatron matrices at 64 MiB per rank, against 25% of the largest buffer;
    # docs/TORCH.md). A fraction bounds it (the C++ engine's own default is 0.25).
    fraction = float(os.environ.get("FASTA2A_STAGING_FRACTION", "0"))
    if not 0 <= fraction <= 1:
        raise ValueError(f"fasta2a: FASTA2A_STAGING_FRACTION={fraction} is not in [0, 1]")
    args = dict(store=store, rank=rank, size=size, servers=servers, gpus_per_server=gpus,
                timeout_s=timeout.total_seconds(), decomposer=dec, scaleup_provider=up, scaleout_provider=out,
                plans_kept=kept, staging_fraction=fraction, root_host=_root_host())
    made = _C.Engine(**args) if inner is None else _C.ProcessGroupFasta2a(inner=inner, **args)
    text = made.describe()
    if "WARNING" in text and rank == 0:
        warnings.warn("fasta2a: " + text[text.index("WARNING"):], RuntimeWarning, stacklevel=3)
    return made


def _inner_group(store, rank: int, size: int, timeout: datetime.timedelta):
    """The group that runs the collectives fasta2a does not: gloo, or NCCL with
    ``FASTA2A_INNER_BACKEND=nccl`` in a CUDA build of torch (that path has never run: no GPU here)."""
    inner = os.environ.get("FASTA2A_INNER_BACKEND", "gloo")
    if inner == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    if inner == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("fasta2a: FASTA2A_INNER_BACKEND=nccl, but this torch has no NCCL")
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, timeout)
    raise ValueError(f"fasta2a: FASTA2A_INNER_BACKEND={inner!r}: gloo or nccl")


def _create_backend(opts, pg_options=None):
    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    inner = _inner_group(store, rank, size, timeout)
    return _make(dist.PrefixStore("fasta2a", store), rank, size, list(opts.global_ranks_in_group), timeout,
                 None, None, inner=inner)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True)


def _splits(splits, n: int, what: str) -> List[int]:
    if splits is None:
        return []
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    out = [int(s) for s in splits]
    if len(out) != n:
        raise ValueError(f"fasta2a: {len(out)} {what} split sizes for a group of {n} ranks")
    return out


@dataclass(frozen=True)
class Handle:
    """What a dispatch moved: this rank's split sizes in (sent) and out (received), rows per rank."""
    in_splits: Tuple[int, ...]
    out_splits: Tuple[int, ...]


class _AllToAll(torch.autograd.Function):
    """y = all_to_all(x); its gradient is the all-to-all of dy the other way (the transposed call)."""

    @staticmethod
    def forward(ctx, x, engine, in_splits, out_splits):
        ctx.engine, ctx.in_splits, ctx.out_splits = engine, in_splits, out_splits
        x = x.contiguous()
        y = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        engine.all_to_all_single(y, x, list(out_splits), list(in_splits))
        return y

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        dx = dy.new_empty((sum(ctx.in_splits),) + tuple(dy.shape[1:]))
        ctx.engine.all_to_all_single(dx, dy, list(ctx.in_splits), list(ctx.out_splits))
        return dx, None, None, None


_groups_made = {}


def _default_timeout() -> datetime.timedelta:
    from torch.distributed import distributed_c10d as c10d
    return c10d.default_pg_timeout


def _group_store(group, what: str):
    """(a store of its own, global ranks, rank, size) for a fasta2a object over torch group `group`.

    Each object made over one group gets its own prefix of that group's store, numbered in the
    order they are made (collective: every rank makes them in the same order).
    """
    if not dist.is_initialized():
        raise RuntimeError(f"fasta2a: fasta2a_torch.{what} needs torch.distributed initialised first "
                           "(dist.init_process_group)")
    from torch.distributed import distributed_c10d as c10d
    pg = group if group is not None else c10d._get_default_group()
    store = c10d._pg_map[pg][1]
    if store is None:
        raise RuntimeError("fasta2a: the group has no store to start fasta2a's bootstrap from")
    key = c10d._pg_names.get(pg, "?")
    n = _groups_made.get(key, 0)
    _groups_made[key] = n + 1
    return (dist.PrefixStore(f"fasta2a_group/{key}/{n}", store), dist.get_process_group_ranks(pg),
            dist.get_rank(pg), dist.get_world_size(pg))


class Group:
    """One fasta2a engine for an expert-parallel group, made once and used for every call.

    The shape of DeepEP's ``Buffer``: it holds the bootstrap, the transports and the kept plans.
    ``dispatch`` sends rows of ``x`` to ranks by ``splits`` and returns what arrived with a
    :class:`Handle`; ``combine`` sends them back, and the engine runs the dispatch's plan
    transposed instead of planning. Both are differentiable: the gradient of each is the other
    direction's all-to-all, which again runs a kept plan.

    Collective: every rank of ``group`` makes its Groups in the same order.

    Args:
        group: the torch process group whose ranks this Group spans (default: the world). Any
            backend; fasta2a makes its own bootstrap from that group's store.
        timeout: how long any wait lasts before raising (default: torch's default, 30 minutes).
        decomposer: fasta2a's decomposer (default ``FASTA2A_DECOMPOSER`` or ``birkhoff``).
        plans_kept: plans kept for reuse (1 to 32); in training, the number of MoE layers.
    """

    def __init__(self, group=None, *, timeout: Optional[datetime.timedelta] = None,
                 decomposer: Optional[str] = None, plans_kept: Optional[int] = None):
        store, ranks, self.rank, self.size = _group_store(group, "Group")
        self._engine = _make(store, self.rank, self.size, ranks, timeout or _default_timeout(), decomposer,
                             plans_kept)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None) -> torch.Tensor:
        """``torch.distributed.all_to_all_single``'s semantics on this Group's engine (blocking)."""
        self._engine.all_to_all_single(output, input, _splits(output_split_sizes, self.size, "output"),
                                       _splits(input_split_sizes, self.size, "input"))
        return output

    def exchange_splits(self, splits) -> List[int]:
        """The rows every rank sends this rank, given the rows this rank sends each (an all-gather)."""
        s = torch.tensor(_splits(splits, self.size, "input") or [0] * self.size, dtype=torch.int64)
        return self._engine.gather_splits(s)[:, self.rank].tolist()

    def dispatch(self, x: torch.Tensor, splits) -> Tuple[torch.Tensor, Handle]:
        """Sends ``splits[j]`` rows of ``x`` (in order) to rank j; returns the rows received, by
        source rank, and the handle that ``combine`` needs. Differentiable."""
        in_splits = tuple(_splits(splits, self.size, "input"))
        if sum(in_splits) != x.shape[0]:
            raise ValueError(f"fasta2a: dispatch splits sum to {sum(in_splits)} but x has {x.shape[0]} rows")
        out_splits = tuple(self.exchange_splits(in_splits))
        y = _AllToAll.apply(x, self._engine, in_splits, out_splits)
        return y, Handle(in_splits, out_splits)

    def combine(self, y: torch.Tensor, handle: Handle) -> torch.Tensor:
        """Sends the rows of ``y`` back where ``dispatch`` took them from. Differentiable."""
        if sum(handle.out_splits) != y.shape[0]:
            raise ValueError(f"fasta2a: combine got {y.shape[0]} rows, the dispatch delivered {sum(handle.out_splits)}")
        return _AllToAll.apply(y, self._engine, handle.out_splits, handle.in_splits)

    def barrier(self) -> None:
        self._engine.barrier()

    def stats(self) -> dict:
        """The engine's figures of the last all-to-all (seconds; ``plan_from``: planned, same, transposed)."""
        return self._engine.stats()

    def describe(self) -> str:
        return self._engine.describe()


from .device import DeviceGroup  # noqa: E402  (uses the helpers above)
