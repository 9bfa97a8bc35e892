"""Whole-graph analytical summary: per-layer costs, totals, op counts, unsupported ops, fusion."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from app.core.costs import LayerCost, layer_cost
from app.core.fusion import fuse_graph
from app.core.ir import Graph, Layer, OpKind, UnsupportedAttrs
from app.core.vocab import SoftwareStack


@dataclass(frozen=True, slots=True)
class UnsupportedOp:
    """An op type the cost model has no formula for: how many layers, which, and why."""

    op_type: str
    count: int
    layers: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class GraphAnalysis:
    """Analytical costs of a :class:`Graph` at its bound batch size.

    Totals sum the supported layers only; ``unsupported`` lists the rest (never counted as zero cost
    silently: callers must surface it). ``params`` counts every distinct weight tensor once (tied
    embeddings), so it can be lower than the sum of per-layer ``params``. When the analysis was asked to
    fuse (:func:`analyze` with a ``software_stack``), ``graph`` is the fused graph, ``fused_from[i]`` names
    the nodes layer ``i`` was fused from (empty when it was not fused), ``fusion_rules[i]`` the rule
    (None when not fused) and ``fusion_stack`` the stack whose fusions were applied.
    """

    graph: Graph
    costs: tuple[LayerCost, ...]
    op_counts: dict[str, int]
    unsupported: tuple[UnsupportedOp, ...]
    params: int
    forward_macs: int
    forward_flops: int
    backward_flops: int
    forward_bytes: int
    saved_activation_bytes: int
    fused_from: tuple[tuple[str, ...], ...] = ()
    fusion_rules: tuple[str | None, ...] = ()
    fusion_stack: SoftwareStack | None = None

    @property
    def layer_count(self) -> int:
        """Number of compute layers (shape bookkeeping nodes excluded)."""
        return len(self.graph.layers)

    @property
    def unsupported_layer_count(self) -> int:
        """Number of layers without a cost formula."""
        return sum(u.count for u in self.unsupported)


def analyze(graph: Graph, *, software_stack: SoftwareStack | str | None = None) -> GraphAnalysis:
    """Cost every layer of ``graph`` (see :mod:`app.core.costs` for the formulas) and sum them.

    With a ``software_stack``, first fuse what that stack fuses (:func:`app.core.fusion.fuse_graph`): the
    analysis is then of the fused graph (fewer layers, same FLOPs, less intermediate memory traffic).
    """
    fused_from: tuple[tuple[str, ...], ...] = ()
    rules: tuple[str | None, ...] = ()
    stack = SoftwareStack(software_stack) if software_stack is not None else None
    if stack is not None:
        fusion = fuse_graph(graph, software_stack=stack)
        graph, costs = fusion.graph, fusion.costs
        fused_from = tuple(f.fused_from for f in fusion.layers)
        rules = tuple(f.rule for f in fusion.layers)
    else:
        costs = tuple(layer_cost(layer) for layer in graph.layers)
    op_counts = Counter(layer.op_type for layer in graph.layers)
    by_op: dict[str, list[Layer]] = {}
    for layer, cost in zip(graph.layers, costs, strict=True):
        if not cost.supported:
            by_op.setdefault(layer.op_type, []).append(layer)
    unsupported = tuple(
        UnsupportedOp(
            op_type=op,
            count=len(ls),
            layers=tuple(x.name for x in ls),
            reason=ls[0].attrs.reason if isinstance(ls[0].attrs, UnsupportedAttrs) else "no cost formula",
        )
        for op, ls in sorted(by_op.items())
    )
    ok = [c for c in costs if c.supported]
    return GraphAnalysis(
        graph=graph,
        costs=costs,
        op_counts=dict(sorted(op_counts.items())),
        unsupported=unsupported,
        params=graph.params,
        forward_macs=sum(c.forward_macs for c in ok),
        forward_flops=sum(c.forward_flops for c in ok),
        backward_flops=sum(c.backward_flops for c in ok),
        forward_bytes=sum(c.forward_bytes for c in ok),
        saved_activation_bytes=sum(c.saved_activation_bytes for c in ok),
        fused_from=fused_from,
        fusion_rules=rules,
        fusion_stack=stack,
    )


# Cost families whose FLOPs are 2 × MACs: the ops ``torch.utils.flop_counter.FlopCounterMode`` counts.
MAC_CLASS_KINDS = frozenset(
    {OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM, OpKind.MATMUL, OpKind.RECURRENT, OpKind.ATTENTION}
)


def mac_class_flops(analysis: GraphAnalysis) -> int:
    """Forward FLOPs (2 × MACs) of the MAC-class layers only (conv, conv_transpose, gemm, matmul, recurrent,
    fused attention's two products).

    This is the figure comparable with ``torch.utils.flop_counter.FlopCounterMode``, which counts
    ``2 × MACs`` of matmul/addmm/bmm/baddbmm/convolution/scaled-dot-product-attention kernels and nothing
    else (no bias adds, norms, activations, softmax, pooling, elementwise ops). It equals
    ``2 × analysis.forward_macs``; ``analysis.forward_flops`` additionally counts the per-element ops.
    """
    return sum(2 * c.forward_macs for c in analysis.costs if c.supported and c.kind in MAC_CLASS_KINDS)
