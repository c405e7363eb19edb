"""This machine's side of a multi-node rendezvous: does it own the endpoint's address, and
which network interface reaches it.

torch's c10d rendezvous guesses which node hosts the store by matching the endpoint against
the machine's hostname, so an endpoint given as an IP address is hosted by nobody and every
node waits until its timeout. The launcher decides instead: node 0 hosts the store, and
must own the endpoint's address (checked by binding a socket to it, before anything
starts). gloo picks its interface from the hostname too; the interface whose address routes
to the endpoint is the one the job's peers can reach, so that one is given to gloo
(``GLOO_SOCKET_IFNAME``) unless the user chose one. Linux only for the interface; nothing is
sent anywhere.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import socket
import struct

__all__ = ["interface_of", "owns_address", "resolve", "route_source"]

_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str | None:
    """The IPv4 address of ``host`` (a name or an address), None if it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def owns_address(host: str) -> bool:
    """Whether ``host``'s address is one of this machine's (a socket can bind to it)."""
    ip = resolve(host)
    if ip is None:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def route_source(host: str) -> str | None:
    """This machine's address on the route to ``host`` (a UDP socket's local end after a
    connect, which sends nothing), None if there is no route."""
    ip = resolve(host)
    if ip is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError:
            return None
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address``, None if none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            with contextlib.suppress(OSError):
                fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
                if socket.inet_ntoa(request.tobytes()[20:24]) == address:
                    return name
    return None
