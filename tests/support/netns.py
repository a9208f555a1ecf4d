"""Test hosts made of Linux network namespaces: a few "machines" on one private switch, whose links a test can cut.

Each host is a network namespace with loopback and one interface, ``eth0``, holding an IPv4 address in a /24. Every
``eth0`` is one end of a veth pair whose other end is a port of a bridge, and the bridge lives in a namespace of its
own (the *switch*). Nothing is added to the machine's own namespace, so the subnet cannot clash with its networks and
deleting the namespaces removes every interface with them (a veth pair dies with either end). A random 10.x.y.0/24
that no local address or route uses is chosen anyway, so that a later link to the machine's namespace stays safe and
logs of networks side by side tell them apart.

Names carry the creating process's PID (``lftnet<pid>-<host>``), so tests may build networks side by side, and
networks left behind by a test process that was killed can be recognised and removed by the next one.

``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts`` for the command it runs. Each host
gets one: the machine's hostname and ``localhost`` resolve to loopback (as on many containers, and whatever the
machine's own ``/etc/hosts`` or DNS says, which a namespace without a route could not ask), and every host's name
resolves to its address, so processes can address each other by name.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ``ip``; :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

PREFIX = "lftnet"
NETNS_ETC = Path("/etc/netns")
IP_TIMEOUT_S = 30.0


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and its output."""


def ip(*args: str, timeout: float = IP_TIMEOUT_S) -> str:
    """Run ``ip ARGS`` and return its stdout; raise :class:`NetnsError` with its stderr if it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, or the kernel refuses), or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the tests as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except (NetnsError, subprocess.TimeoutExpired) as error:
        return f"cannot create a network namespace: {error}"
    try:
        # `ip netns exec` also needs a mount namespace and a fresh /sys, which some containers refuse.
        ip("netns", "exec", probe, "true")
    except (NetnsError, subprocess.TimeoutExpired) as error:
        return f"cannot run a command in a network namespace: {error}"
    finally:
        with suppress(NetnsError, subprocess.TimeoutExpired):
            ip("netns", "del", probe)
    return None


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale_networks() -> list[str]:
    """Delete namespaces (and hosts files) this module made in processes that no longer exist; return their names.

    A test process killed outright (SIGKILL, a CI timeout) cannot run its teardown. Only names of the form
    ``lftnet<pid>-...`` whose PID is gone are touched.
    """
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                ip("netns", "del", name)
            except NetnsError:
                continue
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            removed.append(name)
    return removed


def _used_ipv4_networks() -> list[ipaddress.IPv4Network]:
    """Networks of this namespace's IPv4 addresses and routes (the ones a new subnet must not overlap)."""
    networks = []
    for line in ip("-4", "-o", "addr", "show").splitlines() + ip("-4", "route", "show", "table", "all").splitlines():
        for word in line.split():
            try:
                networks.append(ipaddress.IPv4Network(word, strict=False))
            except ValueError:
                continue
    return [network for network in networks if network.prefixlen > 0]  # a default route overlaps everything


def free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that overlaps no address or route of this namespace."""
    used = _used_ipv4_networks()
    for _ in range(1000):
        candidate = ipaddress.IPv4Network(f"10.{rng.randrange(256)}.{rng.randrange(256)}.0/24")
        if not any(candidate.overlaps(network) for network in used):
            return candidate
    raise NetnsError("no free 10.x.y.0/24: every candidate overlaps a local address or route")


@dataclass(frozen=True)
class VirtualHost:
    """One test host: a network namespace with ``eth0`` at ``address``, plugged into switch port ``port``."""

    name: str
    netns: str
    address: str
    port: str


class VirtualNetwork:
    """Hosts on one switch, built by :func:`virtual_network` (which also tears it down).

    ``command`` prefixes an argv so it runs on a host (``ip netns exec`` replaces itself with the command, so the PID
    of a ``Popen`` is the command's own). ``partition`` unplugs a host from the switch; the host keeps its address
    and loopback, so processes on it keep talking among themselves while packets to and from other hosts are lost, as
    with a pulled cable. ``heal`` plugs it back in; TCP connections that have not given up carry on.
    """

    def __init__(self, host_names: Sequence[str], seed: int | None = None) -> None:
        if len(set(host_names)) != len(host_names) or not host_names:
            raise ValueError(f"host names must be distinct and at least one: {list(host_names)}")
        for name in host_names:  # they become namespace names and /etc/hosts entries
            if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?", name):
                raise ValueError(f"host name {name!r}: use lowercase letters, digits and inner hyphens, at most 32")
        if len(host_names) > 250:
            raise ValueError("at most 250 hosts fit in the /24")
        self.id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"  # unique even for networks built with one seed
        self.subnet = free_subnet(random.Random(seed))
        self.switch = f"{self.id}-switch"
        addresses = list(self.subnet.hosts())
        self.hosts: dict[str, VirtualHost] = {
            name: VirtualHost(name=name, netns=f"{self.id}-{name}", address=str(addresses[index]), port=f"p{index}")
            for index, name in enumerate(host_names)
        }
        self._namespaces: list[str] = []  # created so far, so that a failure halfway tears down exactly these
        self._partitioned: set[str] = set()

    def __getitem__(self, name: str) -> VirtualHost:
        return self.hosts[name]

    # ------------------------------------------------------------------ building
    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        """Create the switch and the hosts. On failure, whatever was created is deleted again."""
        try:
            self._add_namespace(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            hosts_file = self._hosts_file()
            for host in self.hosts.values():
                self._add_namespace(host.netns)
                etc = NETNS_ETC / host.netns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
                ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns",
                   host.netns)  # fmt: skip
                ip("-n", self.switch, "link", "set", host.port, "master", "br0")
                ip("-n", self.switch, "link", "set", host.port, "up")
                ip("-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
                ip("-n", host.netns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"127.0.0.1 {socket.gethostname()}"]
        lines += [f"{host.address} {host.name}" for host in self.hosts.values()]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ using
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs on ``host`` (for ``subprocess.Popen``)."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def run_in(self, host: str, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion (within ``timeout``), capturing its output."""
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    def partition(self, host: str) -> None:
        """Unplug ``host`` from the switch: nothing passes between it and the other hosts until :meth:`heal`."""
        ip("-n", self.switch, "link", "set", self.hosts[host].port, "down")
        self._partitioned.add(host)

    def heal(self, host: str) -> None:
        """Plug ``host`` back into the switch."""
        ip("-n", self.switch, "link", "set", self.hosts[host].port, "up")
        self._partitioned.discard(host)

    @property
    def partitioned(self) -> frozenset[str]:
        return frozenset(self._partitioned)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Delete every namespace and hosts file this network created, even if some deletions fail.

        Stop the processes running on the hosts first: a namespace outlives its name while a process is still in it
        (its interfaces with it), although ``ip netns del`` succeeds.
        """
        errors = []  # (closing twice is harmless: the second finds nothing left to delete)
        for name in reversed(self._namespaces):
            try:
                ip("netns", "del", name)
            except (NetnsError, subprocess.TimeoutExpired) as error:
                errors.append(str(error))
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self._namespaces.clear()
        if errors:
            raise NetnsError("teardown left namespaces behind: " + "; ".join(errors))


@contextmanager
def virtual_network(host_names: Sequence[str], seed: int | None = None) -> Iterator[VirtualNetwork]:
    """Build hosts ``host_names`` on one switch for the duration of the ``with`` block; delete them afterwards.

    ``seed`` picks the subnet (reproducible addresses); the namespace names are unique either way.
    """
    remove_stale_networks()
    network = VirtualNetwork(host_names, seed=seed)
    network.build()
    try:
        yield network
    finally:
        network.close()
