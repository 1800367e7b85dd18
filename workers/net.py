"""Network helpers for the worker processes: a free TCP port, and the interface that reaches a peer.

No Ray here: the FSDP workers also run in plain processes (world 1, torchrun).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

__all__ = ["free_port", "interface_towards", "pin_interface"]

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(address: str) -> tuple[str | None, str]:
    """``(interface name, local IPv4)`` this host uses to reach ``address`` (routing table lookup).

    A connected UDP socket sends nothing; ``getsockname`` gives the source address the kernel
    picked for the route, and the interface is the one holding that address. For a peer on this
    host (``127.0.0.x`` or this host's own IP) that is the loopback or the host's own interface;
    for a peer on another node it is the interface that reaches it. The name is ``None`` when no
    interface holds the source address (it is still returned).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(address), 9))
        source = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == source:
            return name, source
    return None, source


def pin_interface(master_addr: str, cuda: bool = False) -> str | None:
    """Point gloo (and nccl's bootstrap) at the interface that reaches rank 0, unless the user did;
    returns the ``GLOO_SOCKET_IFNAME`` in effect.

    The route to MASTER_ADDR decides: rank 0 on this host -> the loopback; on another node -> the
    interface facing it. gloo's default (the address the hostname resolves to) is often a
    loopback alias that other nodes cannot reach.
    """
    ifname, _ = interface_towards(master_addr)
    if ifname is not None:
        for name in ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if cuda else []):
            os.environ.setdefault(name, ifname)
    return os.environ.get("GLOO_SOCKET_IFNAME")
