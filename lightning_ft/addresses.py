"""Small facts about addresses, shared by the launcher (which must not import torchft just for them) and listeners."""

from __future__ import annotations

import ipaddress
import socket

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
