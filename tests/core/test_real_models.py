"""Real architectures (transformers BERT, GPT-2, ViT, ResNet-50, MobileNetV2; torch LSTM/GRU LMs)
imported from ONNX and checked against an independent oracle and published figures.

Convention (see tests/core/real_models.py): the oracle, ``FlopCounterMode`` on the same module and
shapes, counts 2 × MACs of matmul/conv/bmm/attention kernels only; we compare it with
``mac_class_flops`` (conv, conv_transpose, gemm, matmul, recurrent layers). Norms, activations,
softmax, elementwise and pooling, which the oracle ignores, are in ``forward_flops`` and checked to be
a small positive remainder, never the bulk.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from app.core.analysis import analyze, mac_class_flops
from app.core.ir import OpKind
from app.core.onnx_import import EVAL_EXPORT_WARNING, import_onnx
from app.errors import UnboundDimension

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.core.real_models import SEQ, exported  # noqa: E402

HF = ["bert", "gpt2", "vit", "resnet50", "mobilenet_v2"]
RNN = ["lstm_lm", "lstm_bi_lm", "gru_lm"]

# Published parameter counts: BERT-base 110 M (Devlin et al. 2019), GPT-2 small 124 M (Radford et al.
# 2019, HF model card), ViT-B/16 86 M (Dosovitskiy et al. 2021, Table 1), ResNet-50 25.6 M and
# MobileNetV2 3.5 M (torchvision model docs; Sandler et al. 2018).
PUBLISHED_PARAMS_M = {"bert": 110, "gpt2": 124, "vit": 86, "resnet50": 25.6, "mobilenet_v2": 3.5}
# Published forward GMACs at 224x224: ResNet-50 4.1, MobileNetV2 0.30, ViT-B/16 17.6 (torchvision docs).
PUBLISHED_GMACS = {"resnet50": 4.1, "mobilenet_v2": 0.30, "vit": 17.6}


@functools.cache
def _analysis(name: str):
    e = exported(name)
    return e, analyze(import_onnx(e.onnx_bytes, batch_size=e.batch_size, dims=e.dims, name=name))


@pytest.fixture(scope="module", autouse=True)
def _release_analyses() -> Iterator[None]:
    """The analyses of :func:`_analysis` are shared by this module's tests only: released after them, they would
    otherwise stay in the worker for the rest of the run (and slow every later full garbage collection)."""
    yield
    _analysis.cache_clear()


@pytest.mark.parametrize("name", HF + RNN)
def test_params_and_flops_agree_with_flopcounter_oracle(name: str) -> None:
    e, a = _analysis(name)
    assert not a.unsupported, a.unsupported  # every layer costed, none silently zero
    assert a.params == pytest.approx(e.torch_params, rel=0.02)
    assert mac_class_flops(a) == pytest.approx(e.oracle_flops, rel=0.02)
    # the ops the oracle ignores are counted, but they are a small remainder of the work
    assert mac_class_flops(a) < a.forward_flops < 1.1 * mac_class_flops(a)


@pytest.mark.parametrize("name", HF)
def test_params_agree_with_published_counts(name: str) -> None:
    _, a = _analysis(name)
    assert a.params / 1e6 == pytest.approx(PUBLISHED_PARAMS_M[name], rel=0.02)


@pytest.mark.parametrize("name", sorted(PUBLISHED_GMACS))
def test_vision_macs_agree_with_published_counts(name: str) -> None:
    _, a = _analysis(name)
    assert a.forward_macs / 1e9 == pytest.approx(PUBLISHED_GMACS[name], rel=0.02)


def test_mac_class_flops_is_twice_the_macs() -> None:
    _, a = _analysis("resnet50")
    assert mac_class_flops(a) == 2 * a.forward_macs


def test_gpt2_tied_embedding_is_counted_once() -> None:
    e, a = _analysis("gpt2")
    assert e.tied  # lm_head.weight is transformer.wte.weight in the module
    wte = 50257 * 768
    assert a.params == e.torch_params  # 124.44 M, not 163 M
    assert sum(c.params for c in a.costs) == a.params + wte  # two layers use it ...
    assert a.graph.shared_weights == ("m.transformer.wte.weight",)  # ... and it is listed once
    users = [layer for layer in a.graph.layers if any(w.name == "m.transformer.wte.weight" for w in layer.weights)]
    assert {layer.kind for layer in users} == {OpKind.EMBEDDING, OpKind.GEMM}


def test_attention_matmuls_between_activations_are_counted() -> None:
    e, a = _analysis("bert")
    attn = [(layer, c) for layer, c in zip(a.graph.layers, a.costs, strict=True) if layer.kind is OpKind.MATMUL]
    assert len(attn) == 24  # Q·Kᵀ and A·V in 12 layers, none counted as zero
    # each is 12 heads × SEQ × SEQ × 64 MACs; together they are exactly the oracle's bmm count
    assert all(c.forward_macs == 12 * SEQ * SEQ * 64 for _, c in attn)
    assert sum(c.forward_flops for _, c in attn) == e.oracle_by_op["aten.bmm"]
    # both operands are activations: two input gradients, no weight gradient
    assert all(c.backward_input_flops == 2 * c.forward_flops and c.backward_weight_flops == 0 for _, c in attn)


def test_text_model_scales_with_bound_sequence_and_batch() -> None:
    e = exported("bert")
    base = analyze(import_onnx(e.onnx_bytes, batch_size=1, dims={"seq": 16}))
    long = analyze(import_onnx(e.onnx_bytes, batch_size=2, dims={"seq": 32}))
    gemm = lambda a: sum(c.forward_flops for c in a.costs if c.kind is OpKind.GEMM)  # noqa: E731
    mm = lambda a: sum(c.forward_flops for c in a.costs if c.kind is OpKind.MATMUL)  # noqa: E731
    # token-wise projections scale with batch × seq (pooler: batch only); attention with batch × seq²
    assert gemm(long) == pytest.approx(4 * gemm(base), rel=0.01)
    assert mm(long) == 8 * mm(base)
    assert long.params == base.params


def test_unbound_sequence_dimension_is_named() -> None:
    e = exported("gpt2")
    with pytest.raises(UnboundDimension) as err:
        import_onnx(e.onnx_bytes, batch_size=1)
    assert err.value.detail["dimension"] == "seq"


def test_repeated_imports_of_a_real_model_give_identical_numbers() -> None:
    e = exported("bert")
    first = analyze(import_onnx(e.onnx_bytes, batch_size=2, dims=e.dims))
    second = analyze(import_onnx(e.onnx_bytes, batch_size=2, dims=e.dims))
    assert first.costs == second.costs
    assert (first.params, first.forward_flops, first.backward_flops) == (
        second.params, second.forward_flops, second.backward_flops)


def test_depthwise_convolutions_of_mobilenet_are_not_overcounted() -> None:
    _, a = _analysis("mobilenet_v2")
    dw = [(layer, c) for layer, c in zip(a.graph.layers, a.costs, strict=True)
          if layer.kind is OpKind.CONV and layer.group > 1]
    assert len(dw) == 17
    for layer, c in dw:
        n, ch, *spatial = layer.outputs[0].shape
        assert layer.group == ch
        assert c.forward_macs == n * ch * spatial[0] * spatial[1] * 9  # not × ch


def test_lstm_counts_every_timestep_direction_and_layer() -> None:
    from tests.core.real_models import RNN_BATCH, RNN_EMB, RNN_HIDDEN, RNN_SEQ, RNN_VOCAB

    _, a = _analysis("lstm_bi_lm")
    rec = [c for c in a.costs if c.kind is OpKind.RECURRENT]
    assert len(rec) == 2
    h, t, b = RNN_HIDDEN, RNN_SEQ, RNN_BATCH
    # 4 gates × H × (I + H) MACs per step, direction and sample; layer 2 reads 2H features
    assert rec[0].forward_macs == t * b * 2 * 4 * h * (RNN_EMB + h)
    assert rec[1].forward_macs == t * b * 2 * 4 * h * (2 * h + h)
    head = t * b * 2 * h * RNN_VOCAB
    assert a.forward_macs == rec[0].forward_macs + rec[1].forward_macs + head
    assert all(c.backward_weight_flops == c.forward_flops for c in rec)


@pytest.mark.parametrize("constant_folding", [True, False])
def test_tiny_gpt2_tie_survives_both_export_forms(constant_folding: bool) -> None:
    # folding on: the head is a transposed copy of wte in a second initializer; off: Transpose(wte) node
    import torch
    import transformers as tf

    from tests.core.real_models import _export, _perturb, _wrap

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=500, n_positions=64,
                                             use_cache=False, attn_implementation="eager")).eval()
    _perturb(model)
    x = torch.randint(0, 500, (1, 8))
    content = _export(_wrap(model, "input_ids"), (x,), dynamic={0: "batch", 1: "seq"},
                      constant_folding=constant_folding)
    g = import_onnx(content, batch_size=1, dims={"seq": 8})
    assert g.params == sum(p.numel() for p in model.parameters())
    assert g.shared_weights == ("m.transformer.wte.weight",)


@pytest.mark.parametrize(("name", "flagged"), [("resnet50", True), ("mobilenet_v2", True), ("bert", False)])
def test_eval_mode_export_with_folded_batchnorm_is_flagged(name: str, flagged: bool) -> None:
    # the fixtures are exported in eval mode with constant folding: BN vanishes into the CNNs' convs
    _, a = _analysis(name)
    warns = [w for w in a.graph.warnings if w.startswith(EVAL_EXPORT_WARNING)]
    assert bool(warns) is flagged
    assert "BatchNormalization" not in a.op_counts
