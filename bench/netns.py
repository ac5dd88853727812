"""Simulated hosts on one machine: network namespaces on a bridge, for multi-node tests and
bench/mttr_nodes.py. Needs root and `ip` (iproute2).

    root ns: bridge 10.77.N.254/24 --- veth --- ns A: 10.77.N.1
                                   \\-- veth --- ns B: 10.77.N.2   (and so on)

Each namespace has its own loopback, so nothing but the veth network joins them. The root
namespace owns the bridge address (``bridge_addr``): a service there (an etcd) is reached
from every namespace at that address, and ``blackhole(key, addr)`` cuts one namespace off
from one address (a node that loses etcd while it still reaches its peers). Names carry the
pid so parallel runs never collide; ``down()`` kills what is left in the namespaces, by
pid, and removes every link and namespace it made.
"""

from __future__ import annotations

import os
import signal
import subprocess


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def free_subnet() -> int:
    """A 10.77.N.0/24 no interface of this host uses yet (N from the pid: parallel runs differ)."""
    used = ip("-4", "-o", "addr", "show").stdout
    for i in range(250):
        n = (os.getpid() + i) % 250 + 1
        if f" 10.77.{n}." not in used:
            return n
    raise RuntimeError("no free 10.77.N.0/24 subnet")


class Net:
    def __init__(self, keys: tuple[str, ...] = ("a", "b")) -> None:
        pid = os.getpid()
        self.n = free_subnet()
        self.bridge = f"plbr{pid}"
        self.bridge_addr = f"10.77.{self.n}.254"
        self.ns = {k: f"pl-{k}-{pid}" for k in keys}
        self.addr = {k: f"10.77.{self.n}.{i + 1}" for i, k in enumerate(keys)}
        self.veth = {k: (f"pv{k}h{pid}", f"pv{k}n{pid}") for k in keys}
        self.made: list[tuple[str, str]] = []

    def up(self) -> "Net":
        ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for key, ns in self.ns.items():
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            host_if, ns_if = self.veth[key]
            ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            self.made.append(("link", host_if))
            ip("link", "set", ns_if, "netns", ns)
            ip("link", "set", host_if, "master", self.bridge)
            ip("link", "set", host_if, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{self.addr[key]}/24", "dev", ns_if)
            ip("-n", ns, "link", "set", ns_if, "up")
        return self

    def exec_prefix(self, key: str) -> list[str]:
        """Prefix a command with this to run it in namespace ``key``."""
        return ["ip", "netns", "exec", self.ns[key]]

    def blackhole(self, key: str, addr: str) -> None:
        """Namespace ``key`` can no longer reach ``addr`` (its packets are dropped there)."""
        ip("-n", self.ns[key], "route", "add", "blackhole", f"{addr}/32")

    def heal(self, key: str, addr: str) -> None:
        ip("-n", self.ns[key], "route", "del", "blackhole", f"{addr}/32", check=False)

    def pids(self, key: str) -> list[int]:
        out = ip("netns", "pids", self.ns[key], check=False).stdout
        return [int(p) for p in out.split()]

    def down(self) -> None:
        for key in self.ns:  # anything of ours still in a namespace, by pid
            for pid in self.pids(key):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for kind, name in reversed(self.made):
            if kind == "netns":
                ip("netns", "del", name, check=False)
            else:
                ip("link", "del", name, check=False)
