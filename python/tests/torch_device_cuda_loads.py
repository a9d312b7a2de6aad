"""The CUDA build of fasta2a_torch's device engine loads with Debian's CPU-only torch, and on a machine
without a GPU reports no device, with the runtime's reason, both from the module and from
DeviceGroup (a RuntimeError naming the cause, nothing made). On a GPU machine it counts the devices."""

import datetime
import os
import sys

import fasta2a_torch
from fasta2a_torch import _device_cuda as cuda

count, why = cuda.device_count()
print(f"fasta2a_torch._device_cuda: runtime {cuda.runtime}, {count} device(s){': ' + why if why else ''}")
assert cuda.runtime == "CUDA"
if count > 0:
    print("1 passed, 0 failed")
    sys.exit(0)
assert why, "no device, but no reason given"

import torch.distributed as dist  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "0"))
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
try:
    fasta2a_torch.DeviceGroup(runtime="cuda")
    print("DeviceGroup made without a device")
    sys.exit(1)
except RuntimeError as e:
    assert "no device" in str(e), e
    print(f"DeviceGroup(runtime='cuda'): {e}")
print("2 passed, 0 failed")
