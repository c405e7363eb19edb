"""Cutting this process's TCP connections to a host that vanished without a word.

A host whose link went down (or whose machine died) sends no reset: a call on a store it
hosted (torch's TCPStore: an ``add``, a ``compare_set``) then waits for an answer far longer
than the store's own timeout, and torch's rendezvous agent, running in the launcher, waits
with it. Once the node watch has named the host lost, `sever` shuts down every TCP connection
of this process to that address (found through ``/proc/self/fd`` and ``/proc/net/tcp{,6}``),
so each such call fails at once and the launcher can go on with the nodes that remain. Linux
only; elsewhere it cuts nothing (and says so in the log).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from pathlib import Path

__all__ = ["connections_to", "sever"]

log = logging.getLogger(__name__)

_PROC = Path("/proc")


def _proc_hex(address: str) -> set[str]:
    """How ``/proc/net/tcp{,6}`` writes ``address`` (each 32-bit word in host order, hex): an
    IPv4 address also as IPv4-mapped IPv6."""
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        word = ip.packed[::-1].hex().upper()
        return {word, "0000000000000000FFFF0000" + word}
    packed = ip.packed
    return {"".join(packed[i : i + 4][::-1].hex().upper() for i in range(0, 16, 4))}


def _inodes_to(address: str, proc: Path) -> set[str]:
    wanted = _proc_hex(address)
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[2].partition(":")[0] in wanted:
                    inodes.add(fields[9])
    return inodes


def connections_to(address: str, proc: Path = _PROC) -> list[int]:
    """This process's file descriptors of TCP connections to ``address``."""
    inodes = _inodes_to(address, proc)
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(proc / "self" / "fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(proc / "self" / "fd" / fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    found.append(int(fd))
    return found


def sever(address: str) -> int:
    """Shut down every TCP connection of this process to ``address`` (module docstring);
    returns how many."""
    if not (_PROC / "net" / "tcp").exists():
        log.info("cannot cut the connections to %s here (no /proc/net/tcp)", address)
        return 0
    cut = 0
    for fd in connections_to(address):
        with contextlib.suppress(OSError):
            dup = os.dup(fd)
            with socket.socket(fileno=dup) as sock:  # closes the duplicate only
                sock.shutdown(socket.SHUT_RDWR)  # the connection itself: every call on it fails now
                cut += 1
    log.info("cut %d connections to %s", cut, address)
    return cut
