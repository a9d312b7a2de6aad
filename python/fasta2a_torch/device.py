"""Stream-ordered all-to-all between device tensors: fasta2a_torch.DeviceGroup.

A call exchanges counts and plans on the host, queues the rank's work behind everything already on
the caller's stream, and returns; work queued on that stream afterwards sees every byte received
(fasta2a's engine, stream form). Inside a server bytes move by GPU IPC, between servers by
libfabric (through pinned host mirrors where the provider cannot register device memory).

Tensors reach the engine as integers (``data_ptr()``, ``torch.cuda.current_stream().cuda_stream``),
so the same package works with a CPU-only torch and a CUDA torch. ``runtime="cuda"`` uses the
module built against CUDA's runtime; ``runtime="standin"`` the project's stand-in of the GPU
runtime (tests on machines without a GPU: its device memory is its own, from ``DeviceBuffer``).
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
from typing import Optional, Sequence

import torch


def _runtime_module(runtime: str):
    try:
        return importlib.import_module(f"fasta2a_torch._device_{runtime}")
    except ImportError as e:
        raise RuntimeError(f"fasta2a: the {runtime!r} device engine was not built ({e}): the CUDA one needs the "
                           f"CUDA toolkit at build time, the stand-in one is built with the tests") from None


def _byte_counts(splits: Optional[Sequence[int]], rows: int, row_bytes: int, n: int, what: str):
    if splits is None:
        if rows % n:
            raise ValueError(f"fasta2a: {what} tensor's first dimension {rows} cannot be split equally among {n} ranks")
        splits = [rows // n] * n
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != n:
        raise ValueError(f"fasta2a: {len(splits)} {what} split sizes for a group of {n} ranks")
    if any(s < 0 for s in splits):
        raise ValueError(f"fasta2a: negative {what} split size in {splits}")
    if sum(splits) != rows:
        raise ValueError(f"fasta2a: {what} split sizes sum to {sum(splits)} but the {what} tensor's first dimension "
                         f"is {rows}")
    return [s * row_bytes for s in splits]


class DeviceGroup:
    """A stream-ordered fasta2a engine over device memory for the ranks of ``group``.

    Collective: every rank of ``group`` makes its DeviceGroups in the same order. Raises
    RuntimeError when the runtime reports no device.
    """

    def __init__(self, group=None, *, runtime: str = "cuda", timeout: Optional[datetime.timedelta] = None,
                 decomposer: Optional[str] = None, plans_kept: Optional[int] = None):
        from . import _default_timeout, _env_int, _group_store, _providers, _root_host, topology_of
        import torch.distributed as dist
        self.runtime = _runtime_module(runtime)
        count, why = self.runtime.device_count()
        if count < 1:
            raise RuntimeError(f"fasta2a: no device for the {runtime} device engine: {why}")
        store, ranks, self.rank, self.size = _group_store(group, "DeviceGroup")
        servers, gpus = topology_of(ranks, dist.get_world_size())
        timeout = timeout or _default_timeout()
        # The bootstrap's secret, drawn by rank 0 and published before its address (every
        # connection of the bootstrap proves it holds it: only the job's ranks get in).
        key, secret_key = "fasta2a/bootstrap", "fasta2a/secret"
        listener, root_id = None, ""
        if self.rank == 0:
            host = _root_host()
            listener = self.runtime.Listener(host)
            secret = os.urandom(32).hex()
            store.set(secret_key, secret)
            store.set(key, listener.id(host))
        else:
            store.wait([key], timeout)
            root_id = store.get(key).decode()
            secret = store.get(secret_key).decode()
        self._engine = self.runtime.Engine(
            listener, root_id, secret, self.rank, self.size, servers, gpus, timeout.total_seconds(),
            decomposer or os.environ.get("FASTA2A_DECOMPOSER", "birkhoff"), _providers()[1],
            plans_kept or _env_int("FASTA2A_PLANS_KEPT", 1))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, stream: Optional[int] = None) -> torch.Tensor:
        """``all_to_all_single`` between device tensors, queued on ``stream`` (default: torch's current
        CUDA stream). Returns ``output`` at once; its bytes are there for work queued on the stream."""
        if input.dtype != output.dtype or input.device != output.device:
            raise ValueError(f"fasta2a: input ({input.dtype}, {input.device}) and output ({output.dtype}, "
                             f"{output.device}) differ")
        if not input.is_contiguous() or not output.is_contiguous():
            raise ValueError("fasta2a: DeviceGroup moves contiguous tensors (call .contiguous())")
        row = input.element_size() * math.prod(input.shape[1:])
        ins = _byte_counts(input_split_sizes, input.shape[0], row, self.size, "input")
        outs = _byte_counts(output_split_sizes, output.shape[0], row, self.size, "output")
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        self._engine.all_to_all(output.data_ptr(), output.numel() * output.element_size(), input.data_ptr(),
                                input.numel() * input.element_size(), outs, ins, int(stream))
        return output

    def all_to_all_bytes(self, out_ptr: int, out_bytes: int, in_ptr: int, in_bytes: int, out_counts, in_counts,
                         stream: int) -> None:
        """The same on raw device pointers and byte counts (buffers not held by tensors)."""
        self._engine.all_to_all(out_ptr, out_bytes, in_ptr, in_bytes, [int(c) for c in out_counts],
                                [int(c) for c in in_counts], int(stream))

    def synchronize(self) -> None:
        """Waits until every queued call has run; raises an error of one that failed."""
        self._engine.synchronize()

    def forget(self, ptr: int) -> None:
        """Drops the engine's registration of the device memory holding ``ptr``: call it before that
        memory is freed (``torch.cuda.empty_cache()`` included), since a later allocation at the same
        address would otherwise be taken for the old, still registered one."""
        self._engine.forget(int(ptr))

    def describe(self) -> str:
        return self._engine.describe()
