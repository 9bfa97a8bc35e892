"""API schemas of the graphs domain."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.schemas import JsonObject, Name, PositiveInt32, Schema


class JsonGraphCreate(Schema):
    """A model as a JSON layer list (see :mod:`app.core.json_import` for the layer vocabulary)."""

    name: Name = "json-model"
    input_shape: list[PositiveInt32] = Field(min_length=1, description="one sample's shape, without the batch axis")
    input_dtype: Name = "float32"
    layers: list[JsonObject] = Field(min_length=1)


class UnsupportedOpRead(Schema):
    op_type: str
    count: int
    reason: str


class GraphSummary(Schema):
    """Analytical totals of the graph's own layers at ``batch_size``; totals exclude the ops listed in
    ``unsupported``. A training step also runs a loss layer after the graph: a prediction's ``totals`` count it
    and name it (``totals.loss``)."""

    batch_size: int
    dims: dict[str, int]
    layer_count: int
    op_counts: dict[str, int]
    params: int
    forward_macs: int
    forward_flops: int = Field(description="the graph's layers (no training loss layer)")
    backward_flops: int = Field(description="the graph's layers (no training loss layer)")
    unsupported: list[UnsupportedOpRead]
    totals_exclude_unsupported: bool
    warnings: list[str]


class GraphStorage(Schema):
    """What the database keeps of an upload: the structure and shapes, not the weight data."""

    weights_stored: bool = Field(
        description="false: the data of weight-sized tensors was removed before storing (names, dims and "
        "dtypes kept); true only for graphs stored before weights were stripped"
    )
    stored_bytes: int = Field(description="bytes kept in the database for this graph")
    stripped_weight_bytes: int = Field(
        description="declared bytes of weight data not stored: inline data removed plus external data, "
        "which is never read"
    )
    structure_sha256: str | None = Field(
        description="sha256 of the stored (weightless) content: equal for uploads that differ only in the "
        "values of weight-sized tensors (over 65536 elements)"
    )


class GraphRead(Schema):
    id: str = Field(description="sha256 of the content as uploaded (the canonical JSON for a layer list)")
    name: str
    source_format: str
    size_bytes: int = Field(description="size of the upload in bytes")
    created_at: datetime
    storage: GraphStorage
    summary: GraphSummary
    owner: str | None = Field(default=None, description="id of the API key that first uploaded it; null: anonymous")
    notices: list[str] = Field(
        default_factory=list,
        description="on a re-upload of stored content (200): what was done with this request's name, "
        "batch_size and dims (the stored graph and its summary are left as they were); on a new upload with "
        "dims (201): that they bound the summary only, later requests pass their own",
    )


class GraphList(Schema):
    """``GET /v1/graphs``: one page, newest first (ties by id); ``count`` items in it, ``total`` stored."""

    items: list[GraphRead]
    count: int = Field(description="graphs in this page (len(items))")
    total: int = Field(description="every stored graph")
    limit: int
    offset: int


class LayerCostRead(Schema):
    """Analytical cost of one layer for the whole batch (units in the names)."""

    name: str
    op_type: str
    kind: str
    supported: bool
    input_shapes: list[list[int]]
    output_shapes: list[list[int]]
    params: int
    forward_macs: int
    forward_flops: int
    backward_flops: int
    forward_bytes_read: int
    forward_bytes_written: int
    backward_bytes: int
    operational_intensity_flops_per_byte: float


class GraphLayers(Schema):
    graph_id: str
    batch_size: int
    layers: list[LayerCostRead]
    summary: GraphSummary
