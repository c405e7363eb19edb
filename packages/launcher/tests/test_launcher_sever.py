"""Tier 0: ``run.sever`` cuts this process's TCP connections to one address, and only those.

Two connections to a listening socket on 127.0.0.1 and one to ::1 (when the machine has IPv6
loopback): after ``sever("127.0.0.1")`` a receive on the IPv4 ones returns at once with
nothing (the connection is shut down), while the IPv6 one still carries data.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.launcher.run.sever import connections_to, sever

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="no /proc/net/tcp: Linux only")


@contextlib.contextmanager
def _pair(family: int, host: str) -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen()
        client = socket.create_connection(server.getsockname()[:2], timeout=5)
        accepted, _ = server.accept()
        with client, accepted:
            yield client, accepted


def test_sever_cuts_the_connections_to_one_address_only() -> None:
    with _pair(socket.AF_INET, "127.0.0.1") as (a, _), _pair(socket.AF_INET, "127.0.0.1") as (b, _):
        try:
            other = _pair(socket.AF_INET6, "::1")
            c, c_peer = other.__enter__()
        except OSError:
            other, c, c_peer = None, None, None
        try:
            mine = set(connections_to("127.0.0.1"))
            assert {a.fileno(), b.fileno()} <= mine
            assert sever("127.0.0.1") >= 2
            for s in (a, b):
                s.settimeout(5)
                assert s.recv(1) == b"", "a cut connection reads end of stream at once"
            if c is not None and c_peer is not None:
                c_peer.sendall(b"x")
                c.settimeout(5)
                assert c.recv(1) == b"x", "a connection to another address is untouched"
        finally:
            if other is not None:
                other.__exit__(None, None, None)
