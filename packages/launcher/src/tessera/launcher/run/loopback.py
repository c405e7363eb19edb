"""Keep a one-node job's rendezvous on loopback.

torch's elastic agent starts its TCPStore servers listening on every interface. For a
one-node job nothing needs to reach them from outside, so ``loopback_rendezvous()`` hosts
them on 127.0.0.1 instead (on a free port, or the one of an explicit
``--rdzv-endpoint 127.0.0.1:PORT``): it pre-creates the rendezvous store on a socket bound to
127.0.0.1 (the agent's own store of the same port then reuses it, as torch stores are
multi-tenant) and, for the life of the context, has the agent create its shared worker
store the same way. Gloo's own sockets follow ``GLOO_SOCKET_IFNAME=lo``, set by the CLI.
This touches one private method of torch's DynamicRendezvousHandler, in the launcher
process only; tests/test_launcher_cli.py checks that every listening socket of a job is
on loopback, so a torch upgrade that changes it is caught.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

from torch._C._distributed_c10d import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

__all__ = ["loopback_rendezvous", "loopback_store"]

LOOPBACK = "127.0.0.1"


def loopback_store(port: int = 0) -> Any:
    """A multi-tenant TCPStore server listening on 127.0.0.1 only (it owns the socket)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        wait_for_workers=False,
    )


@contextlib.contextmanager
def loopback_rendezvous(port: int = 0) -> Iterator[str]:
    """Yield a ``127.0.0.1:PORT`` rendezvous endpoint whose stores listen on loopback only
    (``port`` 0: any free one)."""
    keep = [loopback_store(port)]  # stores live as long as the context: the agent reuses them
    handler: Any = DynamicRendezvousHandler  # its private method is patched: reached untyped
    original = handler._create_tcp_store_server

    def create(self: DynamicRendezvousHandler, master_addr: str, master_port: int) -> Any:
        keep.append(loopback_store())
        return keep[-1]

    handler._create_tcp_store_server = create
    try:
        yield f"{LOOPBACK}:{keep[0].port}"
    finally:
        handler._create_tcp_store_server = original
        keep.clear()
