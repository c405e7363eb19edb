from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tessera.comm.testing.fixtures import worker_pools  # noqa: F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real launches (marked ``slow``) first, every other test after, each in its order: the
    pytest workers take the long tests while the rest is still queued, and the short ones fill in
    at the end, instead of one worker finishing a long launch while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def ip(*args: str) -> None:
    """Run ``ip ARGS`` (raises on failure)."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def veth_name(pid: int, node: int) -> str:
    """The veth end inside ``node``'s namespace made by the test process ``pid`` (at most 15
    characters)."""
    return f"tsv{pid}{'abc'[node]}"[-15:]


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


@pytest.fixture
def three_namespaces() -> Iterator[tuple[list[str], list[str]]]:
    """Three "nodes" ``tessera-m<K>-<pid>`` and their addresses 10.233.<k>.1-3, each joined by
    a veth pair to one bridge inside a fourth namespace of the test's own (no device outside
    them); ``unplug`` works on them too. Removed after; skipped where they cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the ip command")
    pid, k = os.getpid(), os.getpid() % 250 + 1
    hub = f"tessera-hub-{pid}"
    names = [f"tessera-m{i}-{pid}" for i in range(3)]
    try:
        ip("netns", "add", hub)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ip("netns", "add", name)
            inner, outer = veth_name(pid, i), f"tsh{pid}{i}"[-15:]
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", name)
            ip("link", "set", outer, "netns", hub)
            ip("-n", hub, "link", "set", outer, "master", "br0")
            ip("-n", hub, "link", "set", outer, "up")
            ip("-n", name, "addr", "add", f"10.233.{k}.{i + 1}/24", "dev", inner)
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "link", "set", inner, "up")
        yield names, [f"10.233.{k}.{i + 1}" for i in range(3)]
    finally:
        for name in [*names, hub]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
