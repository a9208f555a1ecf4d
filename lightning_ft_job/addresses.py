"""Small facts about addresses, shared by the launcher (which must not import torchft just for them) and listeners."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and for any address in 127.0.0.0/8 or ``::1`` (brackets allowed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux), for ``GLOO_SOCKET_IFNAME``."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name == "lo" or name.startswith("lo")), None)


def numeric_host(host: str) -> str:
    """``localhost`` resolves differently on different machines; bind the address it stands for here."""
    return LOOPBACK if host == "localhost" else host.strip("[]")


def url_host(host: str) -> str:
    """An IPv6 literal in a URL or ``host:port`` needs brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def family_of(host: str) -> socket.AddressFamily:
    """The socket family of a numeric address: IPv6 literals contain a colon."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def interface_address(name: str) -> str:
    """The IPv4 address of the network interface ``name`` (Linux), for a group that advertises an interface.

    Raises ``ValueError`` naming the interfaces this machine has when ``name`` is not one of them or has no IPv4
    address.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            request = struct.pack("256s", name.encode()[:15])
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
    except OSError as error:
        try:
            known = ", ".join(sorted(n for _, n in socket.if_nameindex()))
        except OSError:
            known = "unknown"
        raise ValueError(
            f"no IPv4 address on interface {name!r} ({error.strerror}); this machine has: {known}"
        ) from None
    return socket.inet_ntoa(reply[20:24])
