from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tessera.comm.testing.fixtures import worker_pools  # noqa: F401


def ip(*args: str) -> None:
    """Run ``ip ARGS`` (raises on failure)."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def veth_name(pid: int, node: int) -> str:
    """The veth end of ``node`` (0 or 1) made by the test process ``pid`` (at most 15 characters)."""
    return f"tsv{pid}{'ab'[node]}"[-15:]


@pytest.fixture
def unplug() -> Callable[..., None]:
    """``unplug(namespace)``: the link of one of ``two_namespaces``' nodes goes down (nothing
    it sends reaches the other node any more); ``unplug(namespace, up=True)`` plugs it back."""

    def down(namespace: str, up: bool = False) -> None:
        _, node, pid = namespace.split("-")
        ip("-n", namespace, "link", "set", veth_name(int(pid), int(node[1:])), "up" if up else "down")

    return down


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str, str]]:
    """Two "nodes": network namespaces ``(node0, node1)`` joined by one veth pair, with node 0's
    address; addresses 10.231.<k>.1 and .2 exist only inside them; removed after the test.
    Skipped (with the reason) where namespaces cannot be made: not root, no ``ip``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the ip command")
    k = os.getpid() % 250 + 1
    names = (f"tessera-n0-{os.getpid()}", f"tessera-n1-{os.getpid()}")
    veth = (veth_name(os.getpid(), 0), veth_name(os.getpid(), 1))
    try:
        ip("netns", "add", names[0])
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        ip("netns", "add", names[1])
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in (0, 1):
            ip("link", "set", veth[i], "netns", names[i])
            ip("-n", names[i], "addr", "add", f"10.231.{k}.{i + 1}/24", "dev", veth[i])
            ip("-n", names[i], "link", "set", "lo", "up")
            ip("-n", names[i], "link", "set", veth[i], "up")
        yield names[0], names[1], f"10.231.{k}.1"
    finally:
        for name in names:  # deleting a namespace removes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
