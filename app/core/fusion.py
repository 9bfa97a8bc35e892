"""What frameworks fuse: multi-tensor optimizer steps and graph patterns that run as one kernel.

Pure (no I/O, no torch). Two parts:

* **Multi-tensor (foreach) optimizer steps.** PyTorch's optimizers on CUDA default to ``foreach=True``
  (PyTorch >= 2.0): each ``_foreach_*`` op of a step launches one kernel per group of up to
  :data:`TENSORS_PER_LAUNCH` parameter tensors (``depth_to_max_tensors`` of
  ``aten/src/ATen/native/cuda/MultiTensorApply.cuh``: 110, 64, 48, 36, 30 for 1 to 5 tensor lists; 48 is
  the depth-3 value, typical of the ops of an SGD-momentum or Adam step), not one kernel per layer. Builds
  with large kernel arguments (CUDA >= 12.1 on Volta and newer) pack up to 7x more tensors per launch
  (``DepthToMaxConfig<true>``: 336 at depth 3), so 48 over-counts launches there: the conservative end.
  :func:`update_kernel_launches` gives a layer's share of those launches.
* **Graph fusion** (:func:`fuse_graph`): an exported graph spells out as several nodes what the framework
  runs as one kernel. A fused layer keeps the FLOPs of its members (forward and backward, summed) and loses
  the intermediate tensors' DRAM traffic (its bytes are those of its external inputs, weights and outputs);
  ``fused_from`` names the member nodes. Rules, applied in this order:

  1. ``attention``: ``MatMul(Q, Kᵀ)`` → [scale ``Mul``/``Div``] → [mask ``Add``/``Where``] → ``Softmax`` →
     [``Cast``] → [``Dropout``] → ``MatMul(P, V)`` becomes one :attr:`OpKind.ATTENTION` layer: PyTorch >= 2.0
     runs ``scaled_dot_product_attention`` (flash / memory-efficient kernels) for ``nn.MultiheadAttention`` and
     the ``transformers`` default ``attn_implementation="sdpa"``; it is costed at the attention roofline
     (both products on the tensor-core peak, Q, K, V and the output moved once), not as two batched GEMMs
     at a convolution efficiency. The ``Transpose`` nodes that split Q, K and V into heads and feed only
     the attention join it: in PyTorch they are views SDPA reads strided (the merge of the heads after it
     stays, a real copy). Every stack but ``tf1-session``, **on GPUs only**: on a CPU the attention stays
     its parts (two batched GEMMs, scale, mask, softmax, dropout), costed one by one. Measured with
     PyTorch 2.13 eager on the profiler's CPU (AVX-512, one thread, ``torch.profiler``): in training with
     ``dropout_p > 0`` (BERT's and GPT-2's 0.1 attention dropout, the ``transformers`` e2e models) CPU SDPA
     runs ``_scaled_dot_product_attention_math``, i.e. ``bmm``, ``mul``, ``_softmax``, ``bernoulli_``,
     ``bmm`` forward and their backward ops, not one kernel; with ``dropout_p = 0`` (ViT) it runs
     ``_scaled_dot_product_flash_attention_for_cpu`` (+ its backward), which took 0.9-1.2x the time of the
     same chain written as separate ops (shapes (2-16, 4-6, 65-128, 64), forward + backward): on a CPU
     the fused kernel saves no time over its parts, so its parts' costs are the CPU answer either way (in
     inference the flash kernel took 0.6-1.0x its parts, 0.6-0.75x at sequence 512: an over-estimate
     there). ``scripts/cpu_sdpa_paths.py`` reproduces these figures.
  2. ``gelu``: the exporter's decomposition of ``F.gelu`` (erf form: ``Div``/``Mul`` → ``Erf`` → ``Add`` →
     ``Mul`` by x → ``Mul`` by 0.5, in either order of the two products) is one GELU kernel in every
     framework. Every stack.
  3. ``bias``: a GEMM (MatMul with a weight) followed by the ``Add`` of a bias vector is ``nn.Linear``, one
     ``addmm`` (cuBLAS adds the bias in its epilogue); a conv's separate bias ``Add`` likewise. Every stack.
  4. ``activation epilogue``: the activation right after a GEMM/conv (Relu, GELU, SiLU, ...) fuses into its
     epilogue only under ``pytorch-compiled`` (Inductor / cuBLASLt epilogues); eager PyTorch, CUDA graphs of
     eager ops, TF1 and bare library calls launch it as its own kernel.
  5. ``pointwise``: under ``pytorch-compiled`` a connected group of element-wise and activation ops whose
     intermediates only the group reads (GPT-2's Python tanh-GELU, a residual add after an activation) is one
     generated Triton kernel (Inductor's pointwise fusion), with the group's external tensors as its traffic.
     Reductions (norms, softmax) are not merged into it: an under-estimate of what Inductor fuses.

  A group fuses only when each intermediate tensor is read by members of the group alone and is not a graph
  output (otherwise it must be written to memory anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from math import prod

from app.core.costs import LayerCost, layer_cost
from app.core.ir import AttentionAttrs, ConvAttrs, GemmAttrs, Graph, Layer, OpKind, Tensor
from app.core.vocab import SoftwareStack

# ``_foreach_*`` calls per step in PyTorch's ``_multi_tensor_<name>`` implementations (torch/optim/*.py,
# PyTorch 2.x, default hyper-parameters, no weight decay): SGD ``_foreach_add_``; momentum
# ``_foreach_mul_``, ``_foreach_add_`` (buffer) + ``_foreach_add_`` (params); Adam ``_foreach_add_`` (step),
# ``_foreach_lerp_``, ``_foreach_mul_``, ``_foreach_addcmul_``, ``_foreach_sqrt``, ``_foreach_div_``,
# ``_foreach_add_``, ``_foreach_addcdiv_``; AdamW one more (decoupled decay ``_foreach_mul_``). Counted from
# the sources; an estimate for versions that differ.
FOREACH_KERNELS_PER_STEP: Mapping[str, int] = {
    "none": 0, "sgd": 1, "momentum": 3, "nesterov": 4, "adagrad": 4, "adadelta": 6, "rmsprop": 4,
    "adam": 8, "adamw": 9,
}
TENSORS_PER_LAUNCH = 48


def update_kernel_launches(param_tensors: int, optimizer: str) -> float:
    """Kernel launches of a foreach optimizer step attributable to a layer with ``param_tensors`` tensors.

    ``FOREACH_KERNELS_PER_STEP[optimizer] × param_tensors / TENSORS_PER_LAUNCH`` (fractional: the launches
    are shared with the other layers' tensors of the same group). 0 for no parameters or ``"none"``.
    Raises ``KeyError`` for an optimizer not in :data:`FOREACH_KERNELS_PER_STEP`.
    """
    if param_tensors < 0:
        raise ValueError(f"param_tensors must be >= 0, got {param_tensors}")
    return FOREACH_KERNELS_PER_STEP[optimizer] * param_tensors / TENSORS_PER_LAUNCH


# ---------------------------------------------------------------------------------------------------
# Graph fusion
# ---------------------------------------------------------------------------------------------------

FUSION_RULES: tuple[str, ...] = ("attention", "gelu", "bias", "activation_epilogue", "pointwise")


#: The kinds of device a fusion rule set is chosen for (:attr:`app.core.hardware.HardwareSpec.kind`).
HARDWARE_KINDS: tuple[str, ...] = ("gpu", "cpu")


def rules_for_stack(stack: SoftwareStack | str, hardware_kind: str = "gpu") -> tuple[str, ...]:
    """The fusion rules that ``stack`` applies on a ``hardware_kind`` device (``"gpu"`` or ``"cpu"``; see the
    module docstring), in application order: on a CPU without ``attention`` (rule 1). Raises ``ValueError``
    for another hardware kind or an unknown stack."""
    if hardware_kind not in HARDWARE_KINDS:
        raise ValueError(f"hardware_kind must be one of {HARDWARE_KINDS}, not {hardware_kind!r}")
    st = SoftwareStack(stack)
    if st is SoftwareStack.TF1_SESSION:
        rules: tuple[str, ...] = ("gelu", "bias")
    elif st is SoftwareStack.PYTORCH_COMPILED:
        rules = FUSION_RULES
    else:
        rules = ("attention", "gelu", "bias")
    return rules if hardware_kind == "gpu" else tuple(r for r in rules if r != "attention")


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """One layer after fusion: the IR record, its cost, and what it was fused from.

    ``rule`` is None and ``fused_from`` empty for a layer left as it was; otherwise ``fused_from`` lists the
    member node names in graph order and ``cost`` sums their FLOPs with the fused layer's own bytes.
    """

    layer: Layer
    cost: LayerCost
    fused_from: tuple[str, ...] = ()
    rule: str | None = None


@dataclass(frozen=True, slots=True)
class FusionResult:
    """A graph with its fused layers (``graph.layers[i]`` is ``layers[i].layer``)."""

    graph: Graph
    layers: tuple[FusedLayer, ...]
    rules: tuple[str, ...]

    @property
    def costs(self) -> tuple[LayerCost, ...]:
        """Per-layer costs in graph order."""
        return tuple(f.cost for f in self.layers)


class _Index:
    """Producer and consumers of every tensor of a layer list (by tensor name)."""

    def __init__(self, entries: Sequence[FusedLayer], graph_outputs: frozenset[str]) -> None:
        self.entries = entries
        self.graph_outputs = graph_outputs
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            for t in e.layer.outputs:
                self.producer[t.name] = i
            for t in e.layer.inputs:
                self.consumers.setdefault(t.name, []).append(i)

    def sole_consumer(self, i: int) -> int | None:
        """The one layer that reads layer ``i``'s single output, if exactly one does and it is internal."""
        outs = self.entries[i].layer.outputs
        if len(outs) != 1 or outs[0].name in self.graph_outputs:
            return None
        readers = self.consumers.get(outs[0].name, [])
        return readers[0] if len(set(readers)) == 1 else None


def _kind(e: FusedLayer) -> OpKind:
    return e.layer.kind


def _op(e: FusedLayer) -> str:
    return e.layer.op_type


def _merge(members: Sequence[FusedLayer], layer: Layer, rule: str) -> FusedLayer:
    """The fused entry: ``layer``'s bytes (external tensors only), the members' FLOPs summed."""
    own = layer_cost(layer)
    cost = replace(
        own,
        forward_macs=sum(m.cost.forward_macs for m in members),
        forward_flops=sum(m.cost.forward_flops for m in members),
        backward_input_flops=sum(m.cost.backward_input_flops for m in members),
        backward_weight_flops=sum(m.cost.backward_weight_flops for m in members),
    )
    names = tuple(n for m in members for n in (m.fused_from or (m.layer.name,)))
    return FusedLayer(layer, cost, names, rule)


def _external_inputs(members: Sequence[FusedLayer]) -> tuple[Tensor, ...]:
    made = {t.name for m in members for t in m.layer.outputs}
    seen: dict[str, Tensor] = {}
    for m in members:
        for t in m.layer.inputs:
            if t.name not in made:
                seen.setdefault(t.name, t)
    return tuple(seen.values())


def _needs_input_grad(members: Sequence[FusedLayer]) -> bool:
    return any(m.layer.needs_input_grad for m in members)


def _apply(entries: list[FusedLayer], groups: list[list[int]], build: Callable[[list[FusedLayer]], FusedLayer]
           ) -> list[FusedLayer]:
    """Replace each group (indices into ``entries``) by its fused entry, placed where its last member was."""
    out: list[FusedLayer | None] = list(entries)
    for g in groups:
        members = [entries[i] for i in sorted(g)]
        fused = build(members)
        for i in g:
            out[i] = None
        out[max(g)] = fused
    return [e for e in out if e is not None]


_SCALE_OPS = frozenset({"Mul", "Div"})
_MASK_OPS = frozenset({"Add", "Where", "Sub"})


def _attention_chain(ix: _Index, i: int) -> list[int] | None:
    """The attention core starting at the ``MatMul(Q, Kᵀ)`` at ``i``, or None if the pattern breaks."""
    chain = [i]
    seen_softmax = False
    while True:
        nxt = ix.sole_consumer(chain[-1])
        if nxt is None or ix.entries[nxt].fused_from:
            return None
        n = ix.entries[nxt]
        if _kind(n) is OpKind.MATMUL:
            probs = ix.entries[chain[-1]].layer.outputs[0].name
            return [*chain, nxt] if seen_softmax and n.layer.inputs[0].name == probs else None
        if seen_softmax:
            ok = _op(n) == "Cast" or _kind(n) is OpKind.DROPOUT
        else:
            ok = _kind(n) is OpKind.SOFTMAX or (_kind(n) is OpKind.ELEMENTWISE and _op(n) in _SCALE_OPS | _MASK_OPS)
        if not ok:
            return None
        seen_softmax = seen_softmax or _kind(n) is OpKind.SOFTMAX
        chain.append(nxt)


def _attention_groups(ix: _Index) -> list[list[int]]:
    groups: list[list[int]] = []
    claimed: set[int] = set()
    for i, e in enumerate(ix.entries):
        if _kind(e) is not OpKind.MATMUL or i in claimed or e.fused_from:
            continue
        chain = _attention_chain(ix, i)
        if chain is None or claimed.intersection(chain) or len(e.layer.inputs) != 2:
            continue
        last = ix.entries[chain[-1]].layer
        if len(last.inputs) == 2 and _attention_attrs(e.layer.inputs[0], e.layer.inputs[1], last.inputs[1]):
            views = _head_split_views(ix, (e.layer.inputs[0], e.layer.inputs[1], last.inputs[1]),
                                      (chain[0], chain[0], chain[-1]))  # fmt: skip
            group = [*chain, *(v for v in views if v not in claimed)]
            groups.append(group)
            claimed.update(group)
    return groups


def _head_split_views(ix: _Index, operands: tuple[Tensor, ...], readers: tuple[int, ...]) -> list[int]:
    """The ``Transpose`` layers that produce the attention's Q, Kᵀ and V and feed only it: the head split
    (``view(…).permute(0, 2, 1, 3)``, ``k.transpose(-1, -2)``) is a view that
    ``scaled_dot_product_attention`` reads strided, so no copy runs (the exporter writes it as a node)."""
    out: list[int] = []
    for t, reader in zip(operands, readers, strict=True):
        p = ix.producer.get(t.name)
        if p is None or p in out or _op(ix.entries[p]) != "Transpose" or ix.entries[p].fused_from:
            continue
        if ix.sole_consumer(p) == reader:
            out.append(p)
    return out


def _attention_attrs(q: Tensor, kt: Tensor, v: Tensor) -> AttentionAttrs | None:
    """Attention geometry from ``Q (…, heads, q_len, d)``, ``Kᵀ (…, heads, d, kv_len)``, ``V (…, kv_len, d_v)``;
    None when the shapes do not read as one (e.g. a rank-2 product)."""
    if len(q.shape) < 3 or len(kt.shape) != len(q.shape) or len(v.shape) != len(q.shape):
        return None
    *lead, q_len, d = q.shape
    kv_len, d_v = kt.shape[-1], v.shape[-1]
    if kt.shape[-2] != d or v.shape[-2] != kv_len:
        return None
    heads = lead[-1] if len(lead) >= 2 else 1
    batch = int(prod(lead[:-1])) if len(lead) >= 2 else int(prod(lead))
    return AttentionAttrs(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, qk_width=heads * d,
                          v_width=heads * d_v)


def _build_attention(members: list[FusedLayer]) -> FusedLayer:
    products = [m.layer for m in members if m.layer.kind is OpKind.MATMUL]
    first, last = products[0], products[-1]
    q, kt = first.inputs[0], first.inputs[1]
    v = last.inputs[1]
    attrs = _attention_attrs(q, kt, v)
    assert attrs is not None  # _attention_groups keeps only chains whose shapes read as attention
    layer = Layer(
        name=f"{first.name}+attention",
        op_type="Attention",
        kind=OpKind.ATTENTION,
        inputs=_external_inputs(members),
        outputs=last.outputs,
        attrs=attrs,
        needs_input_grad=_needs_input_grad(members),
    )
    return _merge(members, layer, "attention")


def _gelu_groups(ix: _Index) -> list[list[int]]:
    groups: list[list[int]] = []
    for e_i, e in enumerate(ix.entries):
        if _op(e) != "Erf" or e.fused_from or len(e.layer.inputs) != 1:
            continue
        d_i = ix.producer.get(e.layer.inputs[0].name)
        if d_i is None or _op(ix.entries[d_i]) not in _SCALE_OPS or len(ix.entries[d_i].layer.inputs) != 1:
            continue
        if ix.sole_consumer(d_i) != e_i:
            continue
        x = ix.entries[d_i].layer.inputs[0].name
        a_i = ix.sole_consumer(e_i)
        if a_i is None or _op(ix.entries[a_i]) != "Add" or len(ix.entries[a_i].layer.inputs) != 1:
            continue
        members = [d_i, e_i, a_i]
        cur, x_used = a_i, False
        for _ in range(2):  # the product by x and the product by 0.5, in either order
            m_i = ix.sole_consumer(cur)
            if m_i is None or _op(ix.entries[m_i]) != "Mul":
                break
            ok = True
            for t in ix.entries[m_i].layer.inputs:
                if t.name == ix.entries[cur].layer.outputs[0].name:
                    continue
                if t.name == x and not x_used:
                    x_used = True
                    continue
                side = ix.producer.get(t.name)  # Mul(x, 0.5) computed on the side
                if (side is not None and not x_used and _op(ix.entries[side]) == "Mul"
                        and [u.name for u in ix.entries[side].layer.inputs] == [x]
                        and ix.sole_consumer(side) == m_i):
                    members.append(side)
                    x_used = True
                    continue
                ok = False
            if not ok:
                break
            members.append(m_i)
            cur = m_i
        if x_used and len(members) >= 5:
            groups.append(members)
    return groups


def _build_gelu(members: list[FusedLayer]) -> FusedLayer:
    first = members[0].layer  # the Div/Mul that scales x before the Erf
    read = {t.name for m in members for t in m.layer.inputs}
    final = next(m.layer for m in reversed(members) if m.layer.outputs[0].name not in read)
    prefix = first.name.rsplit("/", 1)[0] if "/" in first.name else first.name
    layer = Layer(
        name=f"{prefix}/Gelu",
        op_type="Gelu",
        kind=OpKind.ACTIVATION,
        inputs=(first.inputs[0],),
        outputs=final.outputs,
        needs_input_grad=_needs_input_grad(members),
    )
    return _merge(members, layer, "gelu")


_MAC_ANCHORS = frozenset({OpKind.GEMM, OpKind.CONV, OpKind.CONV_TRANSPOSE})


def _is_bias_add(anchor: Layer, add: Layer) -> bool:
    if add.op_type != "Add" or len(add.inputs) != 1 or len(add.weights) != 1:
        return False
    out = anchor.outputs[0].shape
    if not out:
        return False
    channels = out[1] if anchor.kind in (OpKind.CONV, OpKind.CONV_TRANSPOSE) and len(out) > 1 else out[-1]
    return add.weights[0].numel == channels


def _epilogue_groups(ix: _Index, *, bias: bool, activation: bool) -> list[list[int]]:
    groups: list[list[int]] = []
    for i, e in enumerate(ix.entries):
        if _kind(e) not in _MAC_ANCHORS or e.rule is not None:
            continue
        group = [i]
        nxt = ix.sole_consumer(i)
        if bias and nxt is not None and _is_bias_add(e.layer, ix.entries[nxt].layer):
            group.append(nxt)
            nxt = ix.sole_consumer(nxt)
        if activation and nxt is not None and _kind(ix.entries[nxt]) is OpKind.ACTIVATION and _op(ix.entries[nxt]) \
                != "Cast":
            group.append(nxt)
        if len(group) > 1:
            groups.append(group)
    return groups


def _build_epilogue(members: list[FusedLayer]) -> FusedLayer:
    anchor = members[0].layer
    extra_w = tuple(w for m in members[1:] for w in m.layer.weights)
    acts = [m.layer.op_type for m in members[1:] if m.layer.kind is OpKind.ACTIVATION]
    attrs = anchor.attrs
    if acts and isinstance(attrs, ConvAttrs | GemmAttrs):
        attrs = replace(attrs, activation=acts[0].lower())
    layer = replace(anchor, outputs=members[-1].layer.outputs, weights=anchor.weights + extra_w, attrs=attrs)
    return _merge(members, layer, "activation_epilogue" if acts else "bias")


_POINTWISE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.ACTIVATION})


def _pointwise_groups(ix: _Index) -> list[list[int]]:
    """Connected groups of element-wise/activation layers joined by tensors that only group members read
    (and that are not graph outputs); a group is kept when only its last member's output leaves it, so the
    fused kernel can stand where that member stood."""
    entries = ix.entries
    pw = {i for i, e in enumerate(entries) if _kind(e) in _POINTWISE_KINDS and e.cost.supported}
    parent = {i: i for i in pw}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in pw:
        for t in entries[i].layer.outputs:
            readers = ix.consumers.get(t.name, [])
            if t.name not in ix.graph_outputs and readers and all(r in pw for r in readers):
                for r in readers:
                    parent[find(r)] = find(i)
    comps: dict[int, list[int]] = {}
    for i in sorted(pw):
        comps.setdefault(find(i), []).append(i)
    groups: list[list[int]] = []
    for members in comps.values():
        if len(members) < 2:
            continue
        inside, last = set(members), members[-1]
        leaves = [i for i in members for t in entries[i].layer.outputs
                  if t.name in ix.graph_outputs or any(r not in inside for r in ix.consumers.get(t.name, []))]
        if all(i == last for i in leaves):
            groups.append(members)
    return groups


def _build_pointwise(members: list[FusedLayer]) -> FusedLayer:
    last = members[-1].layer
    layer = Layer(
        name=f"{last.name}+pointwise",
        op_type="Pointwise",
        kind=OpKind.ELEMENTWISE,
        inputs=_external_inputs(members),
        outputs=last.outputs,
        needs_input_grad=_needs_input_grad(members),
    )
    return _merge(members, layer, "pointwise")


def fuse_graph(graph: Graph, *, software_stack: SoftwareStack | str = SoftwareStack.PYTORCH_EAGER,
               hardware_kind: str = "gpu", costs: Sequence[LayerCost] | None = None) -> FusionResult:
    """Fuse what ``software_stack`` fuses on a ``hardware_kind`` device (module docstring;
    :func:`rules_for_stack`) in ``graph``.

    ``costs`` are the layers' costs (``layer_cost`` of each when None). Unsupported layers are never fused.
    Returns a :class:`FusionResult` whose graph keeps the original's inputs, outputs and metadata; every
    layer not fused is returned unchanged with its cost. Pure; never raises for a well-formed graph.
    """
    rules = rules_for_stack(software_stack, hardware_kind)
    base = costs if costs is not None else [layer_cost(x) for x in graph.layers]
    entries = [FusedLayer(x, c) for x, c in zip(graph.layers, base, strict=True)]
    outs = frozenset(t.name for t in graph.outputs)

    def supported(groups: list[list[int]]) -> list[list[int]]:
        return [g for g in groups if all(entries[i].cost.supported for i in g)]

    if "attention" in rules:
        entries = _apply(entries, supported(_attention_groups(_Index(entries, outs))), _build_attention)
    if "gelu" in rules:
        entries = _apply(entries, supported(_gelu_groups(_Index(entries, outs))), _build_gelu)
    if "bias" in rules or "activation_epilogue" in rules:
        groups = _epilogue_groups(_Index(entries, outs), bias="bias" in rules,
                                  activation="activation_epilogue" in rules)
        entries = _apply(entries, supported(groups), _build_epilogue)
    if "pointwise" in rules:
        entries = _apply(entries, supported(_pointwise_groups(_Index(entries, outs))), _build_pointwise)
    fused = replace(graph, layers=tuple(e.layer for e in entries))
    return FusionResult(fused, tuple(entries), rules)
