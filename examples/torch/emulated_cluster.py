"""Puts a rank of examples/cluster's emulated cluster on its own NIC, for fasta2a and gloo alike.

The emulated cluster (examples/cluster/cluster.sh) gives every rank a NIC of its own in its server's
network namespace; traffic leaves through the NIC whose address is its source. ``pin_to_nic()``
names the rank's NIC to both backends before torch.distributed starts:

- the NIC is ``FASTA2A_NIC`` (``cluster.sh launch`` sets it), or ``FASTA2A_NIC_PATTERN`` with
  ``{local_rank}`` filled in (one torchrun per server, which starts every local rank with the same
  environment: ``FASTA2A_NIC_PATTERN=nic{local_rank}``);
- libfabric's tcp provider binds to it (``FI_TCP_IFACE``), gloo listens on it
  (``GLOO_SOCKET_IFNAME``), and ``FASTA2A_BIND_ADDR`` holds its address for
  ``libfasta2a_bind_source.so`` (examples/cluster/bind_source.cpp): preloaded, it binds the
  sockets gloo connects from, which gloo leaves unbound (the kernel would send them all through
  the server's first NIC).

Outside the emulated cluster (neither variable set) it does nothing.
"""

import fcntl
import os
import socket
import struct


def nic_address(nic: str) -> str:
    """The IPv4 address of interface ``nic``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", nic.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR


def pin_to_nic() -> str:
    """Names this rank's NIC to libfabric and gloo (see the module's doc); returns it, or ""."""
    nic = os.environ.get("FASTA2A_NIC", "")
    pattern = os.environ.get("FASTA2A_NIC_PATTERN", "")
    if not nic and pattern:
        nic = pattern.format(local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        os.environ["FASTA2A_NIC"] = nic
    if not nic:
        return ""
    os.environ["FI_TCP_IFACE"] = nic
    os.environ.setdefault("GLOO_SOCKET_IFNAME", nic)
    os.environ.setdefault("FASTA2A_BIND_ADDR", nic_address(nic))
    return nic
