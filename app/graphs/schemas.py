"""API schemas of the graphs domain."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from app.schemas import Schema


class JsonGraphCreate(Schema):
    """A model as a JSON layer list (see :mod:`app.core.json_import` for the layer vocabulary)."""

    name: str = Field(default="json-model", max_length=200)
    input_shape: list[int] = Field(min_length=1, description="one sample's shape, without the batch axis")
    input_dtype: str = "float32"
    layers: list[dict[str, Any]] = Field(min_length=1)


class UnsupportedOpRead(Schema):
    op_type: str
    count: int
    reason: str


class GraphSummary(Schema):
    """Analytical totals at ``batch_size``; totals exclude the ops listed in ``unsupported``."""

    batch_size: int
    dims: dict[str, int]
    layer_count: int
    op_counts: dict[str, int]
    params: int
    forward_macs: int
    forward_flops: int
    backward_flops: int
    unsupported: list[UnsupportedOpRead]
    totals_exclude_unsupported: bool
    warnings: list[str]


class GraphRead(Schema):
    id: str = Field(description="sha256 of the uploaded content")
    name: str
    source_format: str
    size_bytes: int
    created_at: datetime
    summary: GraphSummary


class GraphList(Schema):
    items: list[GraphRead]
    count: int


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
