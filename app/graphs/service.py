"""Graph import and storage: content-addressed, validated before anything is stored, kept without
weight data.

Storage and dedup: the id of an upload is the hex sha256 of its bytes as uploaded (the canonical JSON for
a layer list), so the same file uploaded again is found without parsing it. What is stored for ONNX is
the model with the data of every weight-sized tensor removed (:func:`app.core.onnx_weights.strip_weights`;
names, dims, dtypes and shape-sized constants kept), and its sha256 is ``structure_sha256``: two files
that differ only in the values of weight-sized tensors are two graphs (two ids) with equal
``structure_sha256``.
The upload's summary is computed from the stripped model, the very bytes every later request
re-imports, so the numbers never depend on whether the weights were there.

Analysis cache: a prediction needs the graph imported at its binding and analysed (costed, fused for its
software stack on the kind of device, GPU or CPU: :func:`app.core.fusion.rules_for_stack`). :func:`bound_graph` /
:func:`bound_inline` keep those analyses in one process-wide
:class:`AnalysisCache`, keyed by ``(graph id, batch, dims, software stack, hardware kind)`` (the id names the stored
content, which is never rewritten; inline graphs: the sha256 of their canonical JSON), least recently used
first out, bounded by an estimate of
the bytes the entries hold (:func:`analysis_bytes`), never by an entry count; entries hold the analysis,
its :class:`app.predictor.table.LayerTable` and memoised footprints, never the stored blob, which is read
from the database (a deferred column) only on a miss. A binding whose import fails for a reason that
depends only on the content and the binding (``unbound_dimension``, ``unknown_dimension``,
``invalid_graph``, ``unsupported_opset``) is kept as a :class:`FailedBinding` and answered with the
same error without importing again. Analyses do not depend on the predictor; what a predictor answered
for a binding is memoised on its entry keyed by the predictor's version and object
(:func:`app.predictions.service.memo_estimates`), its bytes counted against the same budget, so a swapped
predictor never gets another's answers.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

from sqlalchemy import event
from sqlalchemy.orm import Session

from app.auth import Principal, check_owner
from app.core.analysis import GraphAnalysis, analyze
from app.core.hardware import HardwareSpec
from app.core.ir import Graph
from app.core.limits import current_limits
from app.core.vocab import SoftwareStack
from app.errors import (
    GraphNotFound,
    InvalidGraph,
    InvalidRequest,
    LayercastError,
    UnboundDimension,
    UnknownDimension,
    UnsupportedOpset,
)
from app.graphs.importer import ImportWorkers, build_graph, content_id, prepare_graph
from app.graphs.models import StoredGraph
from app.graphs.repository import GraphRepository
from app.schemas import MAX_PAGE

#: Default byte budget of the process-wide analysis cache (the app sets ``Settings.analysis_cache_bytes``).
DEFAULT_CACHE_BYTES = 512 * 2**20

# Approximate CPython sizes (bytes) behind analysis_bytes(): a Layer with its LayerCost, a Tensor with its
# shape tuple, name and dtype; measured with tracemalloc on the ResNet-50, BERT and GPT-2 exports
# (benchmarks/perf.py records the estimate next to the traced figure).
_LAYER_BYTES = 1200
_TENSOR_BYTES = 260
LAYOUT_BYTES_PER_LAYER = 1070
"""Approximate bytes of one layer's share of a memoised :class:`app.core.memory.Layout` with the numpy walk its
first footprint compiles onto it (``Layout.walk``; tracemalloc on the ResNet-50, DenseNet-121 and Inception-v2
model-zoo graphs: 916-976 B per layer for the layout, 104-128 more for the walk, 1,020-1,100 in all;
``tests/graphs/test_analysis_cache.py``)."""

T = TypeVar("T")
E = TypeVar("E", "BoundGraph", "FailedBinding")


def analysis_bytes(analysis: GraphAnalysis) -> int:
    """Estimated bytes an analysis holds (layers, costs, tensors, names), for the cache's byte budget."""
    n = 0
    for layer in analysis.graph.layers:
        tensors = len(layer.inputs) + len(layer.outputs) + len(layer.weights) + len(layer.buffers)
        n += _LAYER_BYTES + _TENSOR_BYTES * tensors + 2 * len(layer.name)
    return n


_TABLE_LOCK = threading.Lock()


@dataclass(eq=False)
class BoundGraph:
    """A graph imported at one binding and analysed, plus what every prediction on it reuses: the
    :class:`~app.predictor.table.LayerTable` of its supported layers (built on first use) and memoised
    results of pure functions of the analysis (footprints, largest batches). Shared between requests
    and threads: everything in it is immutable or computed idempotently."""

    key: Hashable
    analysis: GraphAnalysis
    graph_id: str | None
    nbytes: int
    _tables: dict[bool, Any] = field(default_factory=dict)
    _memo: dict[Hashable, Any] = field(default_factory=dict)

    def has_loss_row(self, training: bool) -> bool:
        """Whether :meth:`table` for ``training`` ends with the loss layer (a training step on a graph with a
        floating-point output: :func:`app.core.analysis.loss_layer`)."""
        return training and self.analysis.loss is not None

    def table(self, reference: HardwareSpec, *, training: bool = False) -> Any:
        """The :class:`~app.predictor.table.LayerTable` of the supported layers, in graph order, and for a
        ``training`` step the loss layer after them (:meth:`has_loss_row`): what one step runs (``reference``:
        any device with an fp32 peak, used only while building it)."""
        with_loss = self.has_loss_row(training)
        if with_loss not in self._tables:
            from app.predictor.table import LayerTable

            pairs = self.analysis.step_layers(with_loss)
            me = weakref.ref(self)  # the table must not keep an evicted entry alive (a reference cycle)

            def grow(n: int) -> None:
                entry = me()
                if entry is not None:
                    analysis_cache.grow(entry, n)

            built = LayerTable([p[0] for p in pairs], [p[1] for p in pairs], reference=reference, on_grow=grow)
            with _TABLE_LOCK:  # two threads may build it at once: the one kept is counted, once
                kept = with_loss not in self._tables
                if kept:
                    self._tables[with_loss] = built
            if kept:
                analysis_cache.grow(self, built.nbytes)
        return self._tables[with_loss]

    def recall(self, key: Hashable) -> Any:
        """What :meth:`memo` keeps under ``key``, or ``None`` when nothing is kept yet."""
        return self._memo.get(key)

    def memo(self, key: Hashable, build: Callable[[], T], *, nbytes: int = 0) -> T:
        """``build()`` once per ``key`` (a pure function of this analysis and the key); ``nbytes``: about what
        the result holds, added to this entry's share of the analysis cache's budget."""
        if key not in self._memo:
            built = build()
            # two threads may build it at once: the one kept is counted, once
            if self._memo.setdefault(key, built) is built and nbytes:
                analysis_cache.grow(self, nbytes)
        return self._memo[key]  # type: ignore[no-any-return]


#: Import failures that depend on nothing but the stored content and the binding (the cache key): remembered
#: in the analysis cache, so a graph that cannot be imported at a binding is not imported again on every call.
#: Limits (LimitExceeded, GraphTooLarge: the import deadline, the settings' bounds) are not among them.
REMEMBERED_FAILURES: tuple[type[LayercastError], ...] = (InvalidGraph, UnboundDimension, UnknownDimension,
                                                         UnsupportedOpset)
_FAILURE_BYTES = 600  # a FailedBinding with its key and error, before the message and detail text


@dataclass(frozen=True, eq=False)
class FailedBinding:
    """A binding whose import failed with one of :data:`REMEMBERED_FAILURES`: :meth:`error` is a fresh
    exception equal to the one raised then (same type, message and detail)."""

    key: Hashable
    kind: type[LayercastError]
    message: str
    detail: dict[str, Any]
    nbytes: int
    graph_id: str | None = None  # the stored graph it was bound from (None: inline content)

    @classmethod
    def of(cls, key: Hashable, exc: LayercastError, graph_id: str | None = None) -> FailedBinding:
        return cls(key, type(exc), exc.message, dict(exc.detail),
                   _FAILURE_BYTES + 2 * (len(exc.message) + len(repr(exc.detail))), graph_id)

    def error(self) -> LayercastError:
        return self.kind(self.message, detail=dict(self.detail))


class AnalysisCache:
    """Least-recently-used :class:`BoundGraph` (and :class:`FailedBinding`) entries within ``budget_bytes``
    (by their ``nbytes``; an entry larger than the whole budget is answered but not kept). Thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[Hashable, BoundGraph | FailedBinding] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Estimated bytes held now (≤ ``budget_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> BoundGraph | FailedBinding | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, entry: E) -> E:
        with self._lock:
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if entry.nbytes > self.budget_bytes:
                return entry
            self._entries[entry.key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
            return entry

    def grow(self, entry: BoundGraph, nbytes: int) -> None:
        """``entry`` now holds ``nbytes`` more (a memoised result): counted against the budget, least recently
        used entries evicted if it is exceeded (``entry`` itself too, when it alone exceeds it)."""
        with self._lock:
            entry.nbytes += nbytes
            if self._entries.get(entry.key) is not entry:
                return
            self._bytes += nbytes
            while self._bytes > self.budget_bytes and self._entries:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def discard_graph(self, graph_id: str) -> int:
        """Drop every entry bound from the stored graph ``graph_id`` (all bindings, stacks and memoised
        answers); returns how many were dropped. Called when the graph is deleted: a later upload of the same
        content gets the same id but may carry another name, which a kept analysis would still show."""
        with self._lock:
            gone = [k for k, e in self._entries.items() if e.graph_id == graph_id]
            for k in gone:
                self._bytes -= self._entries.pop(k).nbytes
            return len(gone)

    def clear(self, budget_bytes: int | None = None) -> None:
        """Drop every entry (and set a new budget when given)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            if budget_bytes is not None:
                self.budget_bytes = budget_bytes


#: The process-wide analysis cache (its budget is set from the settings at app start-up).
analysis_cache = AnalysisCache()


def _bind(key: Hashable, graph_id: str | None, load: Callable[[], Graph], stack: SoftwareStack | None,
          hardware_kind: str) -> BoundGraph:
    found = analysis_cache.get(key)
    if isinstance(found, FailedBinding):
        raise found.error()
    if found is not None:
        return found
    try:
        graph = load()
    except REMEMBERED_FAILURES as exc:
        analysis_cache.put(FailedBinding.of(key, exc, graph_id))
        raise
    analysis = analyze(graph, software_stack=stack, hardware_kind=hardware_kind)
    return analysis_cache.put(BoundGraph(key=key, analysis=analysis, graph_id=graph_id,
                                         nbytes=analysis_bytes(analysis)))


def bound_graph(
    session: Session, *, graph_id: str, batch_size: int, dims: Mapping[str, int] | None = None,
    software_stack: SoftwareStack | None = SoftwareStack.PYTORCH_EAGER, hardware_kind: str = "gpu",
) -> BoundGraph:
    """The stored graph ``graph_id`` imported at ``batch_size``/``dims`` and analysed for ``software_stack`` on
    a ``hardware_kind`` device (``"gpu"``/``"cpu"``: what it fuses, :func:`app.core.fusion.rules_for_stack`;
    ignored without a stack), from the analysis cache (a hit reads only the primary-key index; the row and its
    content only on a miss). Raises :class:`GraphNotFound` (404) and what :func:`build_graph` raises (422)."""
    if not GraphRepository(session).exists(graph_id):
        raise GraphNotFound(f"no graph with id '{graph_id}'", detail={"graph_id": graph_id})
    dims = dict(dims or {})
    # a stored row's content is a function of its id (the sha256 of the upload) and is never rewritten, so
    # the id names the content: a hit needs only the existence check, not the row
    kind = hardware_kind if software_stack is not None else None
    key = ("id", graph_id, batch_size, tuple(sorted(dims.items())), software_stack, kind)

    def load() -> Graph:
        row = get_graph(session, graph_id=graph_id)
        try:
            return build_graph(row.content, row.source_format, batch_size=batch_size, dims=dims, name=row.name)
        except UnboundDimension as exc:
            raise _unbound_after_upload(exc, row) from None

    return _bind(key, graph_id, load, software_stack, hardware_kind)


def _unbound_after_upload(exc: UnboundDimension, row: StoredGraph) -> UnboundDimension:
    """``exc`` for a request on the stored ``row``, saying what the upload bound the missing dimension to when
    it did: an upload's ``dims`` bind its stored summary only (the stored graph keeps its symbolic dimensions,
    which every request binds itself; they are not remembered as defaults, so that an answer's shapes come
    from its own request), which the caller must be told, not left to guess. Adds ``upload_value`` to the
    detail; ``exc`` itself when the upload did not bind that dimension."""
    name = exc.detail.get("dimension")
    uploaded = (row.summary.get("dims") or {}).get(name) if isinstance(name, str) else None
    if uploaded is None:
        return exc
    return UnboundDimension(
        f"{exc.message} (the upload's dims bound '{name}' to {uploaded} for the stored summary only; a request "
        f"binds its own, e.g. \"dims\": {{\"{name}\": {uploaded}}} in a prediction's body, dims={name}={uploaded} "
        "in a query)",
        detail={**exc.detail, "upload_value": uploaded})


def bound_inline(
    content: bytes, *, batch_size: int, dims: Mapping[str, int] | None = None,
    software_stack: SoftwareStack | None = SoftwareStack.PYTORCH_EAGER, hardware_kind: str = "gpu",
) -> BoundGraph:
    """An inline JSON graph (canonical bytes, :func:`app.graphs.importer.canonical_json`) bound and analysed like
    :func:`bound_graph`, cached by the sha256 of the content."""
    dims = dict(dims or {})
    kind = hardware_kind if software_stack is not None else None
    key = ("json", content_id(content), batch_size, tuple(sorted(dims.items())), software_stack, kind)
    return _bind(key, None, lambda: build_graph(content, "json", batch_size=batch_size, dims=dims), software_stack,
                 hardware_kind)


@dataclass
class CreateResult:
    """Outcome of :func:`create_graph`: the row, whether it is new, and what the request's ``name``,
    ``batch_size`` and ``dims`` did when the content was stored already (``notices``)."""

    row: StoredGraph
    created: bool
    notices: list[str] = field(default_factory=list)


def _reupload_notices(
    row: StoredGraph, *, name: str, batch_size: int, dims: Mapping[str, int] | None
) -> list[str]:
    notices = []
    if name and name != row.name:
        notices.append(
            f"this content is stored already as '{row.name}'; the stored graph keeps its original name and "
            f"the name '{name}' was not applied"
        )
    stored_batch = row.summary.get("batch_size")
    stored_dims = row.summary.get("dims") or {}
    if batch_size != stored_batch or any(stored_dims.get(k) != v for k, v in (dims or {}).items()):
        notices.append(
            f"the stored summary stays at the binding it was first computed for (batch_size={stored_batch}, "
            f"dims={stored_dims}); batch_size={batch_size} and dims={dict(dims or {})} were not applied: pass "
            "them to GET /v1/graphs/{id}/layers or POST /v1/predictions"
        )
    return notices


def create_graph(
    session: Session,
    *,
    content: bytes | IO[bytes],
    source_format: str,
    name: str,
    batch_size: int = 1,
    dims: Mapping[str, int] | None = None,
    upload_sha256: str | None = None,
    owner: str | None = None,
    content_path: str | None = None,
    workers: ImportWorkers | None = None,
) -> CreateResult:
    """Validate, analyse and store a graph by content hash, without its weight data.

    ``content``: the ONNX upload (bytes, or a binary file positioned at its start, e.g. the spooled
    temporary file of a streamed upload, never read whole into memory) or the canonical JSON layer
    list; ``upload_sha256``: hex sha256 of those bytes when the caller hashed them while streaming
    (required with a file; computed here for bytes). The id is looked up before anything is parsed: an
    identical upload returns the stored row with ``created=False``, changes nothing, and says in ``notices``
    what it did with a different ``name``/``batch_size``/``dims``. Otherwise :func:`prepare_graph` parses,
    strips and imports it: in the import worker process (``workers``, :mod:`app.graphs.importer`) when the
    file is also on disk at ``content_path`` and large enough for :meth:`ImportWorkers.wants`, else here.
    The graph is fully imported before anything is written, so one that fails (:class:`InvalidGraph`,
    :class:`UnboundDimension`, :class:`UnknownDimension`) leaves the database untouched; a worker process that
    dies raises :class:`app.errors.ImportWorkerFailed` (503), nothing stored either.
    ``owner``: the API key id recorded on a new row (:mod:`app.auth`; None: anonymous).
    """
    if isinstance(content, bytes):
        gid = upload_sha256 or content_id(content)
    elif upload_sha256 is None:
        raise ValueError("upload_sha256 is required when content is a file")
    else:
        gid = upload_sha256
    repo = GraphRepository(session)
    existing = repo.get(gid)
    if existing is not None:
        return CreateResult(existing, False, _reupload_notices(existing, name=name, batch_size=batch_size, dims=dims))
    if (workers is not None and content_path is not None and source_format == "onnx"
            and workers.wants(os.path.getsize(content_path))):
        prepared = workers.prepare(content_path, name=name, batch_size=batch_size, dims=dims or {},
                                   limits=current_limits())
    else:
        prepared = prepare_graph(content, source_format, name=name, batch_size=batch_size, dims=dims)
    row = StoredGraph(
        id=gid,
        name=(name or prepared.graph_name)[:200],
        source_format=source_format,
        size_bytes=prepared.size,
        stored_bytes=len(prepared.stored),
        weights_stored=False,
        stripped_weight_bytes=prepared.stripped_bytes,
        structure_sha256=content_id(prepared.stored),
        content=prepared.stored,
        summary=prepared.summary,
        owner=owner,
    )
    bound = ",".join(f"{k}={v}" for k, v in (dims or {}).items())  # the query's own syntax, dims=seq=128,...
    notices = [] if not dims else [
        f"dims={bound} bound this upload's summary only: the graph is stored with its symbolic dimensions, "
        "so POST /v1/predictions and GET /v1/graphs/{id}/layers each pass their own dims"]
    return CreateResult(repo.add(row), True, notices)


def delete_graph(session: Session, *, graph_id: str, principal: Principal) -> None:
    """Delete the stored graph ``graph_id`` on behalf of ``principal``; raises :class:`GraphNotFound`
    (404) or :class:`app.auth.NotOwner` (403: another key owns it, :func:`app.auth.check_owner`). Flushes."""
    repo = GraphRepository(session)
    row = repo.get(graph_id)
    if row is None:
        raise GraphNotFound(f"no graph with id '{graph_id}'", detail={"graph_id": graph_id})
    check_owner(principal, row.owner, what="graph", ident=graph_id)
    repo.delete(row)
    # this process's analyses of it (other workers keep theirs: README); again once the delete is committed, for
    # a prediction that read the row before the commit and cached its analysis meanwhile
    analysis_cache.discard_graph(graph_id)
    event.listen(session, "after_commit", lambda _s: analysis_cache.discard_graph(graph_id), once=True)


def get_graph(session: Session, *, graph_id: str) -> StoredGraph:
    """The stored graph ``graph_id``; raises :class:`GraphNotFound` (404)."""
    row = GraphRepository(session).get(graph_id)
    if row is None:
        raise GraphNotFound(f"no graph with id '{graph_id}'", detail={"graph_id": graph_id})
    return row


def list_graphs(session: Session, *, limit: int = 100, offset: int = 0) -> tuple[list[StoredGraph], int]:
    """Up to ``limit`` stored graphs after the first ``offset``, newest first (ties by id, so pages do not
    overlap), and the number of all stored graphs. Raises :class:`app.errors.InvalidRequest` (422) unless
    ``1 <= limit <= MAX_PAGE`` and ``offset >= 0``."""
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise InvalidRequest(f"need 1 <= limit <= {MAX_PAGE} and offset >= 0",
                             detail={"limit": limit, "offset": offset})  # fmt: skip
    repo = GraphRepository(session)
    return list(repo.list(limit=limit, offset=offset)), repo.count()


def graph_layers(
    session: Session, *, graph_id: str, batch_size: int, dims: Mapping[str, int] | None = None
) -> tuple[StoredGraph, GraphAnalysis]:
    """Per-layer analytical costs of a stored graph at ``batch_size`` (unfused), from the analysis cache."""
    bound = bound_graph(session, graph_id=graph_id, batch_size=batch_size, dims=dims, software_stack=None)
    return get_graph(session, graph_id=graph_id), bound.analysis
