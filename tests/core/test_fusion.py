"""Fusion of what frameworks fuse (app/core/fusion.py), on real BERT/GPT-2 exports and hand-built graphs."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator

import pytest

from app.core.analysis import analyze
from app.core.costs import layer_cost
from app.core.fusion import FOREACH_KERNELS_PER_STEP, TENSORS_PER_LAUNCH, fuse_graph, update_kernel_launches
from app.core.ir import Graph, Layer, OpKind, Tensor
from app.core.onnx_import import import_onnx
from app.core.vocab import SoftwareStack
from app.hardware.catalog import load_catalog
from app.predictor.base import LayerTimeQuery
from app.predictor.roofline import ATTENTION_EFFICIENCY, KERNEL_FLOOR_MS, STREAM_EFFICIENCY, RooflinePredictor

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.core.real_models import exported  # noqa: E402

N_LAYERS = 12  # BERT-base and GPT-2 small both have 12 blocks


@functools.cache
def _graph(name: str) -> Graph:
    e = exported(name)
    return import_onnx(e.onnx_bytes, batch_size=e.batch_size, dims=e.dims)


@pytest.fixture(scope="module", autouse=True)
def _release_graphs() -> Iterator[None]:
    """The graphs of :func:`_graph` are shared by this module's tests only: released after them, they would
    otherwise stay in the worker for the rest of the run (and slow every later full garbage collection)."""
    yield
    _graph.cache_clear()


def test_bert_eager_fuses_attention_gelu_and_bias_keeping_flops() -> None:
    g = _graph("bert")
    r = fuse_graph(g, software_stack=SoftwareStack.PYTORCH_EAGER)
    rules = Counter(f.rule for f in r.layers if f.rule)
    assert rules["attention"] == N_LAYERS and rules["gelu"] == N_LAYERS
    assert rules["bias"] >= 6 * N_LAYERS  # Q, K, V, attention output, intermediate, output dense per block
    ops = Counter(x.op_type for x in r.graph.layers)
    assert ops["Erf"] == 0 and ops["Softmax"] == 0  # all absorbed
    unfused = [layer_cost(x) for x in g.layers]
    assert sum(c.forward_flops for c in r.costs) == sum(c.forward_flops for c in unfused)
    assert sum(c.backward_flops for c in r.costs) == sum(c.backward_flops for c in unfused)
    assert sum(c.forward_bytes for c in r.costs) < sum(c.forward_bytes for c in unfused)
    attn = next(f for f in r.layers if f.rule == "attention")
    assert attn.layer.kind is OpKind.ATTENTION
    members = [name.rsplit("/", 1)[-1] for name in attn.fused_from]
    assert [m for m in members if m.startswith("MatMul")] == ["MatMul", "MatMul_1"] and "Softmax" in members
    # the head-split permutes of Q, K (to Kᵀ) and V are views SDPA reads strided; the head merge is a copy
    assert sorted(m for m in members if m.startswith("Transpose")) == ["Transpose", "Transpose_1", "Transpose_2"]
    assert ops["Transpose"] == N_LAYERS
    # the fused layer moves Q, K, V and the output once: no score matrix in its bytes
    assert attn.cost.forward_bytes == sum(t.nbytes for t in (*attn.layer.inputs, *attn.layer.outputs))
    gelu = next(f for f in r.layers if f.rule == "gelu")
    assert [n.rsplit("/", 1)[-1] for n in gelu.fused_from] == ["Div", "Erf", "Add", "Mul", "Mul_1"]
    assert gelu.layer.inputs[0].shape == gelu.layer.outputs[0].shape
    assert gelu.cost.forward_bytes == 2 * gelu.layer.outputs[0].nbytes


def test_fusion_depends_on_the_stack() -> None:
    g = _graph("bert")
    compiled = Counter(f.rule for f in fuse_graph(g, software_stack="pytorch-compiled").layers if f.rule)
    tf1 = Counter(f.rule for f in fuse_graph(g, software_stack="tf1-session").layers if f.rule)
    # Inductor folds the GELU into the intermediate dense's epilogue
    assert compiled["activation_epilogue"] >= N_LAYERS and compiled["gelu"] == 0
    assert tf1["attention"] == 0 and tf1["gelu"] == N_LAYERS


def test_gpt2_attention_is_fused_but_its_python_tanh_gelu_is_not_under_eager() -> None:
    g = _graph("gpt2")
    r = fuse_graph(g, software_stack="pytorch-eager")
    assert Counter(f.rule for f in r.layers)["attention"] == N_LAYERS
    # HF's gelu_new is Python arithmetic: eager PyTorch launches each op, so nothing fuses it
    assert Counter(x.op_type for x in r.graph.layers)["Tanh"] == N_LAYERS


def test_analysis_reports_fused_nodes_per_layer() -> None:
    g = _graph("bert")
    a = analyze(g, software_stack="pytorch-eager")
    assert a.fusion_stack is SoftwareStack.PYTORCH_EAGER and a.layer_count < len(g.layers)
    assert len(a.fused_from) == len(a.costs) == a.layer_count
    assert sum(len(f) for f in a.fused_from if f) + sum(1 for f in a.fused_from if not f) == len(g.layers)
    assert analyze(g).fused_from == ()  # no stack: no fusion


def _chain(out_is_graph_output: bool) -> Graph:
    x = Tensor("x", (8, 1024, 3072))
    d, e, a, m, y = (Tensor(n, x.shape) for n in ("d", "e", "a", "m", "y"))
    layers = (
        Layer("div", "Div", OpKind.ELEMENTWISE, (x,), (d,)),
        Layer("erf", "Erf", OpKind.ACTIVATION, (d,), (e,)),
        Layer("add", "Add", OpKind.ELEMENTWISE, (e,), (a,)),
        Layer("mul", "Mul", OpKind.ELEMENTWISE, (x, a), (m,)),
        Layer("mul_1", "Mul", OpKind.ELEMENTWISE, (m,), (y,)),
    )
    outs = (y, e) if out_is_graph_output else (y,)
    return Graph("gelu", layers, (x,), outs, batch_size=8)


def test_an_intermediate_that_is_a_graph_output_blocks_fusion() -> None:
    assert [f.rule for f in fuse_graph(_chain(False)).layers] == ["gelu"]
    assert all(f.rule is None for f in fuse_graph(_chain(True)).layers)


def test_foreach_launches_are_shared_across_tensors() -> None:
    assert update_kernel_launches(TENSORS_PER_LAUNCH, "adam") == FOREACH_KERNELS_PER_STEP["adam"]
    assert update_kernel_launches(2, "sgd") == pytest.approx(2 / TENSORS_PER_LAUNCH)
    assert update_kernel_launches(0, "adam") == 0 == update_kernel_launches(5, "none")


def test_fused_attention_is_costed_at_the_attention_roofline() -> None:
    g = _graph("bert")
    r = fuse_graph(g)
    attn = next(f for f in r.layers if f.rule == "attention")
    hw = load_catalog()["a100-sxm4-40gb"]
    q = LayerTimeQuery(attn.layer, attn.cost, hw, "inference", "none", precision="bf16")
    (est,) = RooflinePredictor().estimate([q])
    bound_s = max(attn.cost.forward_flops / (hw.peak_flops_per_s["bf16"] * ATTENTION_EFFICIENCY),
                  attn.cost.forward_bytes / 2 / (hw.memory_bandwidth_bytes_per_s * STREAM_EFFICIENCY))
    assert est.forward_ms == pytest.approx(bound_s * 1e3 + KERNEL_FLOOR_MS)
    # one kernel instead of the 4-6 the unfused members would launch
    members = [f for f in fuse_graph(g, software_stack="tf1-session").layers if f.layer.name in attn.fused_from]
    unfused = RooflinePredictor().estimate(
        [LayerTimeQuery(m.layer, m.cost, hw, "inference", "none", precision="bf16") for m in members])
    assert est.forward_ms < sum(e.forward_ms for e in unfused)


def test_compiled_graphs_fuse_pointwise_chains_into_one_kernel() -> None:
    """Inductor generates one kernel for GPT-2's Python tanh-GELU (8 ops) that eager runs op by op."""
    g = _graph("gpt2")
    eager = fuse_graph(g, software_stack=SoftwareStack.PYTORCH_EAGER)
    compiled = fuse_graph(g, software_stack=SoftwareStack.PYTORCH_COMPILED)
    assert Counter(x.op_type for x in compiled.graph.layers)["Tanh"] == 0
    gelus = [f for f in compiled.layers if f.rule == "pointwise"
             and "Tanh" in [n.rsplit("/", 1)[-1] for n in f.fused_from]]  # fmt: skip
    assert len(gelus) == N_LAYERS
    members = [n.rsplit("/", 1)[-1] for n in gelus[0].fused_from]
    assert "Pow" in members and len(members) == 8
    assert gelus[0].layer.kind is OpKind.ELEMENTWISE and len(gelus[0].layer.inputs) == 1
    assert sum(c.forward_flops for c in compiled.costs) == sum(c.forward_flops for c in eager.costs)
    assert sum(c.forward_bytes for c in compiled.costs) < sum(c.forward_bytes for c in eager.costs)
    assert len(compiled.graph.layers) < len(eager.graph.layers)


def test_a_pointwise_group_whose_middle_is_read_outside_stays_unfused() -> None:
    """The fused kernel stands where its last member stood, so only that member's output may leave it."""
    x, a, b, c = (Tensor(n, (8, 64)) for n in "xabc")

    def graph(middle_read_outside: bool) -> Graph:
        layers = [Layer("relu", "Relu", OpKind.ACTIVATION, (x,), (a,)),
                  Layer("mul", "Mul", OpKind.ELEMENTWISE, (a,), (b,))]
        if middle_read_outside:
            layers.append(Layer("sm", "Softmax", OpKind.SOFTMAX, (a,), (c,)))
        return Graph("g", tuple(layers), (x,), (b, c) if middle_read_outside else (b,), batch_size=8)

    fused = fuse_graph(graph(False), software_stack="pytorch-compiled")
    assert [f.rule for f in fused.layers] == ["pointwise"]
    assert fused.layers[0].cost.forward_bytes == x.nbytes + b.nbytes  # the intermediate never reaches DRAM
    assert all(f.rule is None for f in fuse_graph(graph(True), software_stack="pytorch-compiled").layers)
    assert all(f.rule is None for f in fuse_graph(graph(False), software_stack="pytorch-eager").layers)


def test_a_cpu_keeps_the_attention_core_unfused_and_a_gpu_fuses_it() -> None:
    """PyTorch's CPU SDPA runs the attention of a training step with dropout as separate ops (math path), and
    its CPU flash kernel is no faster than them: a CPU analysis keeps the parts, a GPU one fuses them."""
    g = _graph("bert")
    cpu = fuse_graph(g, software_stack=SoftwareStack.PYTORCH_EAGER, hardware_kind="cpu")
    gpu = fuse_graph(g, software_stack=SoftwareStack.PYTORCH_EAGER, hardware_kind="gpu")
    assert gpu == fuse_graph(g, software_stack=SoftwareStack.PYTORCH_EAGER)  # the GPU answer is unchanged
    cpu_rules = Counter(f.rule for f in cpu.layers if f.rule)
    assert cpu_rules["attention"] == 0 and Counter(f.rule for f in gpu.layers)["attention"] == N_LAYERS
    assert cpu_rules["gelu"] == N_LAYERS and cpu_rules["bias"] >= 6 * N_LAYERS  # the other rules still apply
    ops = Counter(x.op_type for x in cpu.graph.layers)
    assert ops["Softmax"] == N_LAYERS and ops["Attention"] == 0
    assert sum(c.forward_flops for c in cpu.costs) == sum(c.forward_flops for c in gpu.costs)
    assert cpu.rules == tuple(r for r in gpu.rules if r != "attention")
    a = analyze(g, software_stack="pytorch-eager", hardware_kind="cpu")
    assert a.fusion_hardware_kind == "cpu" and "attention" not in a.fusion_rules
    with pytest.raises(ValueError, match="hardware_kind"):
        fuse_graph(g, software_stack="pytorch-eager", hardware_kind="tpu")


def test_the_loss_layer_is_a_cross_entropy_over_the_logits() -> None:
    g = _graph("gpt2")
    a = analyze(g, software_stack="pytorch-eager")
    logits = next(t for t in g.outputs if t.dtype.startswith("float"))
    assert a.loss is not None and a.loss_cost is not None
    assert a.loss.op_type == "SoftmaxCrossEntropyLoss" and a.loss.kind is OpKind.SOFTMAX
    assert a.loss.inputs == (logits,) and a.loss.outputs[0].shape == logits.shape and a.loss.needs_input_grad
    assert a.loss not in a.graph.layers  # a training step adds it after the graph
    assert a.loss_cost.forward_flops == 5 * logits.numel and a.loss_cost.backward_flops > 0
    ints = Graph(name="ids", inputs=(Tensor("x", (2, 3), "int64"),), outputs=(Tensor("y", (2, 3), "int64"),),
                 layers=(), batch_size=2)
    assert analyze(ints).loss is None  # nothing to take a cross-entropy of
