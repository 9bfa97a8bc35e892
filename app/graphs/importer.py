"""Import of an upload: the pure stage (content → what is stored and its summary) and the worker process that
runs it for large ONNX uploads, so that their parse never stalls the serving process.

:func:`prepare_graph` parses, strips the weights, imports, analyses and summarises; it touches no database and
imports no ORM (this module depends on :mod:`app.core` and :mod:`app.errors` only). Why a process: parsing a
protocol-buffers model holds the GIL for stretches that grow with the model: on the 438 MB BERT export one
``MergeFromString`` of the 94 MB word-embedding record held it 41 ms, onnx's C++ shape inference 43 ms, freeing
the parsed message 33 ms (1 ms ticker thread beside each stage). In a worker thread of the server every other
request (``GET /healthz`` included) waited that long: p99 58-72 ms during the upload (benchmarks/upload.py).
:class:`ImportWorkers` runs :func:`prepare_graph` in a separate process that reads the spooled upload from its
path and sends back only a :class:`PreparedGraph` (the stripped model, 0.7 MB for BERT, and the summary), so the
server's own work per upload is receiving, hashing and one insert, and its longest GIL hold no longer depends on
the model's size.

Uploads up to :data:`WORKER_MIN_BYTES` (the in-memory spool size) are imported in the server's worker thread:
their parse is short (bounded by that size), and the process hop would cost more than it saves. One process per
server process (``spawn`` context: a fresh interpreter, nothing inherited from the server's threads; like every
spawned process it imports the server's ``__main__``, which the ``layercast`` script and ``python -m app.cli``
guard), started with the app (``Settings.import_worker_at_start``; ~90 MB resident in a ``layercast serve``
process, 50 of them its own imports) or else when the first large upload begins to arrive
(:meth:`ImportWorkers.start`: its ~0.6 s of imports overlap the transfer), and kept: concurrent large uploads
are imported one at a time and hold one parsed model in memory at a time. It ends with the server, also when
the server is killed without its shutdown (:func:`_exit_with_parent`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import IO, Any

from app.core.analysis import GraphAnalysis, analyze
from app.core.ir import Graph
from app.core.json_import import import_json
from app.core.limits import Limits, use_limits
from app.errors import (
    ImportWorkerFailed,
    InvalidGraph,
    InvalidRequest,
    LayercastError,
    LimitExceeded,
    UnknownDimension,
)


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    """Canonical UTF-8 encoding of a JSON graph (sorted keys, no whitespace): equal graphs hash equal."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def content_id(content: bytes) -> str:
    """Graph id: hex sha256 of the stored content."""
    return hashlib.sha256(content).hexdigest()


def build_graph(
    content: bytes, source_format: str, *, batch_size: int, dims: Mapping[str, int] | None = None, name: str = ""
) -> Graph:
    """Import stored content (``onnx`` bytes or canonical ``json``) into the IR at ``batch_size``.

    Raises :class:`InvalidGraph`, :class:`UnboundDimension`, :class:`UnknownDimension` (422) when
    ``dims`` names a dimension the graph does not have (a typo would otherwise be ignored silently), or
    :class:`InvalidRequest` for a non-positive batch size.
    """
    if batch_size <= 0:
        raise InvalidRequest(f"batch_size must be positive, got {batch_size}", detail={"batch_size": batch_size})
    dims = dict(dims or {})
    graph = _import(content, source_format, batch_size, dims, name)
    unknown = sorted(set(dims) - set(graph.dims))
    if unknown:
        known = sorted(graph.dims)
        raise UnknownDimension(
            f"dims names dimension(s) the graph does not have: {', '.join(map(repr, unknown))}; "
            f"its symbolic dimensions are: {', '.join(map(repr, known)) or 'none'}",
            detail={"unknown_dims": unknown, "graph_dims": known},
        )
    return graph


def _import(content: bytes, source_format: str, batch_size: int, dims: dict[str, int], name: str) -> Graph:
    if source_format == "onnx":
        from app.core.onnx_import import import_onnx  # lazily: JSON-only callers never load onnx

        return import_onnx(content, batch_size=batch_size, dims=dims, name=name or None)
    if source_format == "json":
        try:
            doc = json.loads(content)
        except ValueError as exc:
            raise InvalidGraph(f"stored JSON graph does not parse: {exc}") from exc
        return import_json(doc, batch_size=batch_size)
    raise InvalidGraph(f"unknown source format {source_format!r}")


def summarize(analysis: GraphAnalysis) -> dict[str, Any]:
    """JSON-ready summary (the ``GraphSummary`` schema) of an analysis."""
    g = analysis.graph
    return {
        "batch_size": g.batch_size,
        "dims": dict(g.dims),
        "layer_count": analysis.layer_count,
        "op_counts": analysis.op_counts,
        "params": analysis.params,
        "forward_macs": analysis.forward_macs,
        "forward_flops": analysis.forward_flops,
        "backward_flops": analysis.backward_flops,
        "unsupported": [{"op_type": u.op_type, "count": u.count, "reason": u.reason} for u in analysis.unsupported],
        "totals_exclude_unsupported": bool(analysis.unsupported),
        "warnings": list(g.warnings),
    }


@dataclass(frozen=True)
class PreparedGraph:
    """What is stored for an upload, computed from its content alone (:func:`prepare_graph`): ``stored``, the
    bytes kept (the ONNX model without weight data, or the canonical JSON); ``size``, the upload's bytes;
    ``stripped_bytes``, declared bytes of weight data not stored; ``summary`` at the upload's binding
    (:func:`summarize`); ``graph_name``, the name the importer found in the model. Small and picklable: a worker
    process sends it back (:mod:`app.graphs.importer`)."""

    stored: bytes
    size: int
    stripped_bytes: int
    summary: dict[str, Any]
    graph_name: str


def prepare_graph(
    content: bytes | IO[bytes], source_format: str, *, name: str, batch_size: int,
    dims: Mapping[str, int] | None = None,
) -> PreparedGraph:
    """Parse, strip, import and summarise an upload, touching no database (the pure stage of
    :func:`create_graph`, which runs it here or in the import worker process).

    ``content``: the ONNX upload (bytes, or a binary file positioned at its start, parsed in bounded slices by
    :func:`app.core.onnx_wire.read_model`, never read whole into memory) or the canonical JSON layer list.
    An ONNX model's external-data references are dropped unread and its weight data stripped
    (:func:`app.core.onnx_weights.strip_weights`); the stripped model is imported at ``batch_size`` / ``dims``
    for the summary. Raises :class:`InvalidGraph`, :class:`UnboundDimension`, :class:`UnknownDimension` (422)
    and the limits' :class:`LimitExceeded` (422) / :class:`GraphTooLarge` (413).
    """
    stripped_bytes = 0
    if source_format == "onnx":
        from app.core.onnx_import import parse_model  # imported on first use, as in _import
        from app.core.onnx_weights import strip_weights

        if isinstance(content, bytes):
            size = len(content)
            model = parse_model(content)
        else:
            start = content.tell()
            model = parse_model(content)  # read in bounded slices, never whole next to the parsed model
            size = content.tell() - start
        report = strip_weights(model)
        stored = model.SerializeToString()
        del model
        stripped_bytes = report.stripped_bytes + report.external_bytes
    else:
        stored = content if isinstance(content, bytes) else content.read()
        size = len(stored)
    graph = build_graph(stored, source_format, batch_size=batch_size, dims=dims, name=name)
    return PreparedGraph(stored, size, stripped_bytes, summarize(analyze(graph)), graph.name)


WORKER_MIN_BYTES = 8 * 2**20
"""Uploads larger than this (bytes) are imported in the worker process; equal to the router's in-memory spool
size, so exactly the uploads that were spooled to a named file on disk go there."""

_Outcome = tuple[str, Any]


def _prepare_in_worker(path: str, name: str, batch_size: int, dims: dict[str, int], limits: Limits) -> _Outcome:
    """Worker-process entry: :func:`prepare_graph` of the ONNX file at ``path`` under
    ``limits``. Returns ``("ok", PreparedGraph)`` or, for a client error, ``("error", (type, message, detail))``
    (a :class:`LayercastError` is rebuilt by the server, since subclasses such as ``LimitExceeded`` take other
    constructor arguments than pickling replays); anything else is raised (a bug: 500 in the server)."""
    try:
        with use_limits(limits), open(path, "rb") as f:
            return "ok", prepare_graph(f, "onnx", name=name, batch_size=batch_size, dims=dims)
    except LayercastError as exc:
        return "error", (type(exc), exc.message, exc.detail)


def _exit_with_parent(parent: int) -> None:
    """Worker-process initializer: end the process when the server that started it is gone (killed without its
    shutdown: the pool's queue is never closed, since the worker holds both ends of it, so nothing else would)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="layercast-parent-watch", daemon=True).start()


def _warm() -> None:
    """Worker-process warm-up: import what :func:`prepare_graph` needs for ONNX (onnx: ~0.1 s, its protobuf classes)."""
    import app.core.onnx_import  # noqa: F401
    import app.core.onnx_weights  # noqa: F401


def _rebuild(kind: type[LayercastError], message: str, detail: dict[str, Any]) -> LayercastError:
    """The error the worker raised: same type, message and detail (its constructor is bypassed)."""
    exc = kind.__new__(kind)
    LayercastError.__init__(exc, message, detail=detail)
    return exc


class ImportWorkers:
    """The worker process that imports large ONNX uploads (module docstring). Thread-safe; :meth:`close` at
    shutdown. ``min_bytes``: smaller uploads are not sent here (:meth:`wants`)."""

    def __init__(self, *, min_bytes: int = WORKER_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def wants(self, size: int) -> bool:
        """Whether an ONNX upload of ``size`` bytes is imported in the worker process."""
        return size > self.min_bytes

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        """``fn(*args)`` submitted to the worker process, a new one when the last one died before this call.
        Raises :class:`ImportWorkerFailed` (503) when no process can be started (no usable ``/dev/shm`` or
        semaphores, a process-count limit, out of memory): the upload is refused, not answered with a 500."""
        with self._lock:
            try:
                if self._pool is not None:
                    try:
                        return self._pool.submit(fn, *args)
                    except BrokenProcessPool:  # it died during an earlier call, which was answered then
                        self._pool.shutdown(wait=False, cancel_futures=True)
                        self._pool = None
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_exit_with_parent, initargs=(os.getpid(),))
                return self._pool.submit(fn, *args)
            except (OSError, NotImplementedError, RuntimeError) as exc:
                self._pool = None
                raise ImportWorkerFailed(
                    f"the import worker process could not be started ({type(exc).__name__}: {exc}); nothing was "
                    "stored", detail={"reason": type(exc).__name__}) from exc

    def start(self) -> None:
        """Start the worker process now, without waiting (it imports onnx meanwhile): the router calls this when a
        large upload begins, so that the process starts while the body is still being received."""
        self._submit(_warm)

    def prepare(self, path: str, *, name: str, batch_size: int, dims: Mapping[str, int],
                limits: Limits) -> PreparedGraph:
        """:func:`prepare_graph` of the ONNX file at ``path`` (read there, never sent) in the worker process,
        under ``limits``; blocks the calling thread (not the GIL) until it is done. Returns a
        :class:`PreparedGraph`. Raises what the import raises (422/413 :class:`LayercastError`, same type,
        message and detail) and :class:`ImportWorkerFailed` (503) when the process died during this import
        (killed, out of memory): the next call gets a new process."""
        submitted = time.monotonic()
        future = self._submit(_prepare_in_worker, path, name, batch_size, dict(dims), limits)
        try:
            # one process imports one upload at a time: the wait in its queue counts against the import's
            # deadline too, so that an upload queued behind others is refused after import_timeout_s, not N x
            status, value = future.result(timeout=limits.import_timeout_s)
        except TimeoutError:
            future.cancel()  # not started yet: dropped from the queue; started: it ends at its own deadline
            raise LimitExceeded(
                "import_seconds", round(time.monotonic() - submitted, 3), limits.import_timeout_s,
                f"the import did not finish within import_timeout_s = {limits.import_timeout_s:g} s (waiting for "
                "the import worker included); nothing was stored") from None
        except BrokenProcessPool:
            raise ImportWorkerFailed(
                "the import worker process ended before finishing this upload (killed or out of memory, or it "
                "could not start: a program that runs the app in process must guard its entry point with "
                "`if __name__ == \"__main__\":`, because the worker is a spawned interpreter that imports the "
                "program's main module); nothing was stored"
            ) from None
        if status == "error":
            raise _rebuild(*value)
        prepared: PreparedGraph = value
        return prepared

    def close(self) -> None:
        """Stop the worker process (waits for an import in progress)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
