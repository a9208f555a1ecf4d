"""torchft's HTTP checkpoint transport, as a healing group should run it.

The HTTP transport is how a restarted group receives a live peer's whole training state. torchft 0.2.0's version
gets three things wrong for us, and this subclass changes exactly those:

* **What it loads.** It unpickles the peer's payload with ``weights_only=False``, which runs whatever code the bytes
  name, from whichever address the quorum handed out. The state lightning-ft sends is plain data (tensors, numbers,
  strings, containers), so it is loaded with ``weights_only=True``; a payload naming another object is refused with
  :class:`RefusedPeerStateError`, which no retry can fix.
* **What it advertises.** It tells peers to fetch from ``socket.gethostname()``, whatever address the Manager was
  told to advertise; on a cluster that may resolve onto the slow interface (torchft issue 329). It advertises the
  group's chosen ``hostname`` instead.
* **Where it listens.** It listens on every interface. For a group that advertises a loopback address (a job on one
  machine) it is rebound to that address, so the full weights are not served to the network.

It also receives faster. torch's streaming loader reads each tensor's bytes into a new ``bytes`` object and then
copies them into a second new buffer, so every received byte is allocated (page-faulted) and copied twice. Here each
storage is read straight from the socket into the one tensor that keeps it (:func:`streaming_load_once`); the heal
benchmark in ``docs/benchmarks.md`` measures the difference.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import BinaryIO, cast

import torch
from torchft.checkpointing import HTTPTransport
from typing_extensions import override

from lightning_ft.checkpoint_io import refused_global
from lightning_ft.errors import LightningFTError, UnsupportedArgumentError
from lightning_ft.torch_internals import PseudoZipFile, load_from_zip_file, weights_only_unpickler
from lightning_ft_job.addresses import LOOPBACK, family_of, is_loopback, numeric_host, url_host


class RefusedPeerStateError(LightningFTError, RuntimeError):
    """A live peer's state holds an object that ``weights_only=True`` refuses. Retrying cannot help."""


class _ReadOnceZipFile(PseudoZipFile):
    """torch's in-memory "zip file" of a streamed checkpoint, whose storages are read once, into their final tensors."""

    def read_from(self, f: io.BufferedIOBase) -> None:
        for entry in weights_only_unpickler.load(f):
            if not entry.is_storage:
                self.records[entry.key] = (f.read(entry.length), entry.length)
                continue
            storage = torch.empty(entry.length, dtype=torch.uint8)
            view = storage.numpy().data if entry.length else memoryview(b"")
            received = 0
            while received < entry.length:
                count = f.readinto(view[received:])
                if not count:
                    raise EOFError(f"the peer's state ended after {received} of {entry.length} bytes of {entry.key}")
                received += count
            self.records[entry.key] = (storage, entry.length)

    def get_storage_from_record(self, key: str, _length: int, _type: int) -> torch.Tensor:
        return cast(torch.Tensor, self.records[key][0])  # already the uint8 tensor the storage lives in: no copy


def streaming_load_once(stream: BinaryIO) -> object:
    """torch's ``_streaming_load(stream, weights_only=True)``, with every storage read once into its own tensor."""
    zip_file = _ReadOnceZipFile()
    zip_file.read_from(cast(io.BufferedIOBase, stream))  # an HTTP response or a file: both have readinto()
    return load_from_zip_file(
        zip_file=zip_file, map_location=None, pickle_module=weights_only_unpickler, encoding="utf-8"
    )


# The serving loop stops within one poll once told to (it is poked awake at once, see stop_serving).
SERVER_STOP_TIMEOUT_S = 5.0


def stop_serving(server: ThreadingHTTPServer) -> None:
    """``server.shutdown()``, without its wait of up to half a second.

    ``serve_forever`` looks at its stop flag only between two waits of its 0.5-s poll interval, so ``shutdown()``
    returns up to 0.5 s later; on a restarted group's way to its first quorum, that is time the group is not healing.
    A connection to the server ends the wait at once, so the loop is poked (on loopback) until it has stopped.
    """
    stopper = threading.Thread(target=server.shutdown, name="lightning-ft-http-stop", daemon=True)
    stopper.start()
    port = server.server_address[1]
    host = "::1" if server.address_family == socket.AF_INET6 else LOOPBACK
    while stopper.is_alive():
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=0.5).close()
        stopper.join(timeout=0.01)


def _no_access_log(handler: object, code: object = "-", size: object = "-") -> None:
    """``BaseHTTPRequestHandler.log_request`` without the line."""


class _ThreadingServer(ThreadingHTTPServer):
    request_queue_size = 1024  # as torchft's: every rank of every healing group may ask at once


class CheckpointHTTPTransport(HTTPTransport):
    """torchft's HTTP transport: plain-data loads, the group's own advertised address, loopback when local."""

    _server: ThreadingHTTPServer  # torchft's, replaced by :meth:`_rebind` on loopback

    def __init__(self, hostname: str, timeout: timedelta, num_chunks: int = 0) -> None:
        if num_chunks:
            # torchft's chunked fetch sends a pytree TreeSpec first, which a weights_only load refuses: it could never
            # receive. The one-stream fetch is what the Manager uses.
            raise UnsupportedArgumentError(
                f"lightning-ft: CheckpointHTTPTransport(num_chunks={num_chunks}) is not supported: a chunked heal's "
                f"metadata is a pytree TreeSpec, which the safe (weights_only) load refuses. Use num_chunks=0."
            )
        self._advertised = url_host(hostname)  # before torchft's constructor, which logs address()
        super().__init__(timeout=timeout, num_chunks=num_chunks)
        # http.server prints one access line per request to stderr (`"GET /checkpoint/0/full" 200`) in the serving
        # group's output; the `healed` line of the group that fetched says what happened. Errors are still printed.
        self._server.RequestHandlerClass.log_request = _no_access_log  # type: ignore[attr-defined]
        if is_loopback(hostname):
            self._rebind(numeric_host(hostname))

    def _rebind(self, host: str) -> None:
        """Replace the server torchft started on every interface by one on ``host``, with the same handler."""
        handler = self._server.RequestHandlerClass
        stop_serving(self._server)
        self._server.server_close()
        server_class = type("_BoundServer", (_ThreadingServer,), {"address_family": family_of(host)})
        self._server = server_class((host, 0), handler)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @override
    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and release the port, whatever ``wait``: torchft 0.2's ``shutdown(wait=False)`` sets a flag
        that its server never reads, so the serving thread and the listening socket outlived every fit."""
        stop_serving(self._server)
        self._server.server_close()
        self._thread.join(timeout=SERVER_STOP_TIMEOUT_S)

    @override
    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{self._advertised}:{port}/checkpoint/"

    @classmethod
    @override
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream:
            try:
                return streaming_load_once(stream)
            except pickle.UnpicklingError as error:
                refused = refused_global(error)
                if refused is None:  # damaged on the way: torchft reports it and the next quorum fetches again
                    raise
                raise RefusedPeerStateError(
                    f"lightning-ft: the live peer's training state (from {address}) holds an object that a safe load "
                    f"(weights_only=True) refuses: {refused} Everything in it must be plain data (tensors, numbers, "
                    f"strings, containers), callbacks' state_dict() included; or allow the type with "
                    f"torch.serialization.add_safe_globals([...]) in every replica group."
                ) from error
