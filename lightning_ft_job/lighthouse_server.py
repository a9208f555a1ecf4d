"""The embedded lighthouse: torchft's ``LighthouseServer`` running inside a Python process.

Used in two places: by :class:`~lightning_ft.FTStrategy` when a single replica group runs with no lighthouse
configured (so that ``python train.py`` just works), and by ``lightning-ft lighthouse`` / ``lightning-ft launch``.
It is torchft's own Rust server; this module only picks safe defaults and a reachable address, and, in a process that
has not imported torchft yet (the ``lightning-ft`` command), loads that server without importing torch.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

NATIVE_MODULE = "torchft._torchft"

LOOPBACK_BIND = "127.0.0.1:0"

# Defaults for one machine. A dead group is declared dead after the heartbeat timeout, so the survivors stall for
# about this long. torchft's own default is 5 s, sized for clusters.
LOCAL_HEARTBEAT_TIMEOUT_MS = 1000
# After membership changes, how long the lighthouse waits for groups that heartbeat but have not asked to join yet.
# This is what the survivors of a killed group wait before they commit again: the dead group heartbeats until the
# heartbeat timeout, so a quorum without it forms after min(join timeout, heartbeat timeout). The steady state never
# waits (while every previous member is back, torchft forms a "fast quorum" at once), and the lighthouse's majority
# rule keeps a lone group from leaving a live, heartbeating majority behind, so a short wait costs at most an extra
# membership change when a group is more than this late right after a failure (it joins at the next step and heals).
# The majority rule counts every group waiting at the lighthouse, and the wait is counted from the earliest: a
# LocalSGD/DiLoCo group that waits from its restart to the next sync lets a survivor leave a live peer behind, so
# semi-sync jobs of three or more groups need a join timeout above the time between two quorums (docs/semi-sync.md).
# docs/benchmarks.md measures the kill-to-commit time at two settings. With 2 groups the lone survivor is no
# majority until the dead group's heartbeats expire, so it waits the heartbeat timeout either way.
LOCAL_JOIN_TIMEOUT_MS = 300


class LighthouseBindError(OSError):
    """The lighthouse's address is taken."""


@dataclass
class EmbeddedLighthouse:
    """A running lighthouse and the URL that clients should use to reach it."""

    server: LighthouseServer
    address: str

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(
    bind: str = LOOPBACK_BIND,
    min_replicas: int = 1,
    join_timeout_ms: int = LOCAL_JOIN_TIMEOUT_MS,
    heartbeat_timeout_ms: int = LOCAL_HEARTBEAT_TIMEOUT_MS,
    quorum_tick_ms: int | None = None,
) -> EmbeddedLighthouse:
    """Start a lighthouse on ``bind`` (``host:port``; port 0 picks a free one).

    torchft reports its address with the machine's hostname. When bound to a specific IP (loopback, by default),
    that hostname may not resolve to the bound address, so the URL is rebuilt from the bind host.
    """
    try:
        server = lighthouse_server_class()(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except RuntimeError as error:
        if "Address already in use" not in str(error):
            raise
        raise LighthouseBindError(
            f"lightning-ft: cannot start a lighthouse on {bind}: the port is already in use (another lighthouse, or "
            f"another program, listens there). Give a free port, or port 0 to pick one: --bind / --lighthouse-bind "
            f"HOST:0. To join a lighthouse that already runs there, pass its URL instead (lightning-ft launch "
            f"--lighthouse http://HOST:PORT)."
        ) from error
    reported = server.address()
    port = urlsplit(reported).port
    host = bind.rsplit(":", 1)[0]
    if host in ("", "[::]", "0.0.0.0"):
        address = reported
    else:
        address = f"http://{host}:{port}"
    return EmbeddedLighthouse(server=server, address=address)


def lighthouse_server_class() -> type[LighthouseServer]:
    """torchft's ``LighthouseServer`` class, without importing torch into a process that has not imported it.

    Why: ``import torchft`` imports torch (most of a second of CPU on a small machine), and ``lightning-ft launch``
    paid it before any replica group could start; torch's import in the groups' own processes competes for the same
    cores. The server lives in torchft's native extension ``torchft._torchft``, which links no part of torch, so it
    is loaded from its file directly, at a fraction of the cost. It is registered in ``sys.modules`` under its own
    name: a later ``import torchft`` in this process finds it there (torchft imports it with ``from torchft._torchft
    import ...``), instead of initialising the extension a second time. The one difference: the attribute
    ``torchft._torchft`` is then missing from the package, which torchft itself never reads.

    A process that already imported torchft (every training process) gets the class the usual way. When the
    installed torchft is laid out differently (no such extension file), the usual import is the fallback too.
    """
    if "torchft" in sys.modules:
        from torchft.coordination import LighthouseServer

        return LighthouseServer
    native = sys.modules.get(NATIVE_MODULE) or _load_native_module()
    if native is None:
        from torchft.coordination import LighthouseServer

        return LighthouseServer
    return native.LighthouseServer


def _load_native_module() -> Any:
    """Load ``torchft._torchft`` from torchft's package directory without running ``torchft/__init__``; ``None`` if
    there is no such file."""
    package = importlib.util.find_spec("torchft")  # finds the package; does not import it
    if package is None or not package.submodule_search_locations:
        return None
    for directory in package.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directory, "_torchft" + suffix)
            if os.path.isfile(path):
                spec = importlib.util.spec_from_file_location(NATIVE_MODULE, path)
                if spec is None or spec.loader is None:
                    return None
                module = importlib.util.module_from_spec(spec)
                sys.modules[NATIVE_MODULE] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[NATIVE_MODULE]
                    raise
                return module
    return None
