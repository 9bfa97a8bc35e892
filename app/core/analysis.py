"""Whole-graph analytical summary: per-layer costs, totals, op counts, unsupported ops, fusion."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from app.core.costs import VIEW_OPS, LayerCost, layer_cost
from app.core.fusion import fuse_graph
from app.core.ir import Graph, Layer, OpKind, Tensor, UnsupportedAttrs
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
    (None when not fused), ``fusion_stack`` the stack whose fusions were applied and ``fusion_hardware_kind``
    the kind of device (``"gpu"``/``"cpu"``) they were chosen for. ``loss``/``loss_cost``: the training
    step's cross-entropy on the graph's output (:func:`loss_layer`; None when no output is floating point),
    not one of ``graph.layers`` (an exported graph ends at the logits): training time and memory add it.
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
    fusion_hardware_kind: str | None = None
    loss: Layer | None = None
    loss_cost: LayerCost | None = None

    @property
    def layer_count(self) -> int:
        """Number of compute layers (shape bookkeeping nodes excluded)."""
        return len(self.graph.layers)

    @property
    def unsupported_layer_count(self) -> int:
        """Number of layers without a cost formula."""
        return sum(u.count for u in self.unsupported)

    def step_layers(self, training: bool) -> list[tuple[Layer, LayerCost]]:
        """What one step runs, as ``(layer, cost)`` pairs: the supported layers in graph order and, for a
        ``training`` step with a :attr:`loss`, the loss layer after them (the rows of the served layer table,
        :meth:`app.graphs.service.BoundGraph.table`, and of ``evaluate``'s whole-iteration check)."""
        pairs = [(layer, cost) for layer, cost in zip(self.graph.layers, self.costs, strict=True) if cost.supported]
        if training and self.loss is not None and self.loss_cost is not None:
            pairs.append((self.loss, self.loss_cost))
        return pairs


#: ``op_type`` of the loss layer a training step adds after the graph (:func:`loss_layer`; ONNX's name of the op)
#: when the graph ends at the logits: cross-entropy, ``log_softmax`` then NLL.
LOSS_OP_TYPE = "SoftmaxCrossEntropyLoss"
#: Name of that layer (in the layer table and the page's layers CSV).
LOSS_ROW_NAME = "loss/cross_entropy"
#: ``op_type`` and name of the loss layer when the graph already ends in its own ``Softmax``/``LogSoftmax``
#: (:func:`loss_on_probabilities`): only the NLL part of cross-entropy is left to run (ONNX's name of the op).
NLL_OP_TYPE = "NegativeLogLikelihoodLoss"
NLL_ROW_NAME = "loss/nll"
#: Ops whose output is (log-)probabilities over the last axis: a graph ending in one has run the softmax
#: of cross-entropy itself.
PROBABILITY_OPS = frozenset({"Softmax", "LogSoftmax"})


def loss_input(outputs: Sequence[Tensor]) -> Tensor | None:
    """The tensor a training step's loss reads among a graph's ``outputs``: the first floating-point one (the
    logits), or None when no output is floating point. The one choice the loss time (:func:`loss_layer`) and
    the loss memory (:func:`app.core.memory.footprint`, both of its walks) share."""
    return next((t for t in outputs if t.dtype.startswith(("float", "bfloat"))), None)


def loss_on_probabilities(layers: Sequence[Layer], x: Tensor) -> bool:
    """Whether the loss input ``x`` is the output of a :data:`PROBABILITY_OPS` layer among ``layers`` (a graph
    ending in ``Softmax``/``LogSoftmax``), directly or through view layers (:data:`app.core.costs.VIEW_OPS`,
    taken at their first input: a ``Flatten``/``Reshape``/``Identity`` after the softmax, as exports often end,
    moves no value): the loss then runs no softmax of its own (:func:`loss_layer`), and keeps no
    log-probabilities of its own in memory (:func:`app.core.memory.footprint`)."""
    producers = {t.name: la for la in layers for t in la.outputs}
    name, seen = x.name, set()
    while name in producers and name not in seen:
        seen.add(name)
        producer = producers[name]
        if producer.op_type in PROBABILITY_OPS:
            return True
        if producer.op_type not in VIEW_OPS or not producer.inputs:
            return False
        name = producer.inputs[0].name
    return False


def loss_layer(graph: Graph) -> Layer | None:
    """The loss of a training step on ``graph`` as a layer, over the last axis of :func:`loss_input`
    ``[..., classes]``; None when the graph has no floating-point output.

    - The graph ends at the logits (an export's usual end): cross-entropy, ``F.cross_entropy`` (``log_softmax``
      then ``nll_loss``; backward ``nll_loss_backward`` + ``_log_softmax_backward_data``), with the cost family
      of a softmax over that tensor (:attr:`OpKind.SOFTMAX`: 5 FLOPs per element forward, the output-sized
      log-probabilities written and read back by backward): :data:`LOSS_OP_TYPE`.
    - The graph ends in its own ``Softmax``/``LogSoftmax`` (:func:`loss_on_probabilities`), already costed as
      a graph layer with its backward: the step is costed as what PyTorch runs for that pattern, the graph's
      (log-)softmax followed by ``F.nll_loss`` on its output (exact for ``LogSoftmax``; for ``Softmax`` the
      usual training form, ``CrossEntropyLoss`` on the logits, whose ``log_softmax`` costs the same 5 FLOPs per
      element as the graph's softmax), so no second softmax is added: :data:`NLL_OP_TYPE`, an elementwise
      layer with one loss per row (``rows = numel / classes`` FLOPs forward and backward) whose backward writes
      the probabilities' output-sized gradient (``nll_loss_backward`` zero-fills it and scatters one value per
      row). Its bytes follow the elementwise rules of :func:`app.core.costs.layer_cost`: the forward reads all
      the log-probabilities and the backward reads them again as its saved input, an upper bound (the forward
      kernel gathers one per row, the backward reads only the per-row gradient): about 3x the bytes PyTorch
      moves: 3 output-sized passes over memory (cross-entropy's softmax family counts 5) where the kernels make
      about 1.

    The profiler's whole training iterations (:mod:`app.profiler.e2e`) time ``forward`` with the loss and
    ``loss.backward()``, and an exported graph ends at the logits, so without this layer the layer sum misses
    it (GPT-2's 50,257-word vocabulary: ~10 % of a CPU step). A model trained with another loss (regression,
    a fused head) is costed with this one."""
    x = loss_input(graph.outputs)
    if x is None:
        return None
    if loss_on_probabilities(graph.layers, x):
        rows = x.shape[:-1] or (1,)
        per_row = Tensor(f"{x.name}/nll", rows, x.dtype)
        return Layer(name=NLL_ROW_NAME, op_type=NLL_OP_TYPE, kind=OpKind.ELEMENTWISE, inputs=(x,),
                     outputs=(per_row,), needs_input_grad=True)
    log_probs = Tensor(f"{x.name}/log_probs", x.shape, x.dtype)
    return Layer(name=LOSS_ROW_NAME, op_type=LOSS_OP_TYPE, kind=OpKind.SOFTMAX, inputs=(x,),
                 outputs=(log_probs,), needs_input_grad=True)


def analyze(graph: Graph, *, software_stack: SoftwareStack | str | None = None,
            hardware_kind: str = "gpu") -> GraphAnalysis:
    """Cost every layer of ``graph`` (see :mod:`app.core.costs` for the formulas) and sum them.

    With a ``software_stack``, first fuse what that stack fuses on a ``hardware_kind`` device (``"gpu"`` or
    ``"cpu"``: :func:`app.core.fusion.fuse_graph`; a CPU keeps the attention core unfused): the analysis is
    then of the fused graph (fewer layers, same FLOPs, less intermediate memory traffic). Raises
    ``ValueError`` for another hardware kind.
    """
    fused_from: tuple[tuple[str, ...], ...] = ()
    rules: tuple[str | None, ...] = ()
    stack = SoftwareStack(software_stack) if software_stack is not None else None
    if stack is not None:
        fusion = fuse_graph(graph, software_stack=stack, hardware_kind=hardware_kind)
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
    loss = loss_layer(graph)
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
        fusion_hardware_kind=hardware_kind if stack is not None else None,
        loss=loss,
        loss_cost=layer_cost(loss) if loss is not None else None,
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
