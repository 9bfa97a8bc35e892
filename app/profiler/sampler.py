"""Layer configurations to profile, drawn from the shapes real architectures use.

A :class:`LayerConfig` is one layer at one batch size. Its description is, wherever the JSON layer list
can express it, a one-layer graph document that :func:`app.core.json_import.import_json` accepts
(``{"input_shape": [...], "layers": [spec]}`` + ``batch_size``); batched matmul and attention, which the
JSON format lacks, carry an explicit shape record (``shapes``) that :meth:`LayerConfig.to_layers` turns
into the same IR an ONNX import would give (``MatMul`` / ``Softmax`` layers). So every measured row can be
rebuilt into :class:`app.core.ir.Layer` records and costed by :mod:`app.core.costs`.

Sampling (:func:`sample_configs`, deterministic for a seed, and the first ``n`` configs of a larger
draw are the same as a draw of ``n``): pick a family by weight (:data:`FAMILY_WEIGHTS`), then with
probability ``1 - uniform_fraction`` a layer of a real architecture from the catalogs below (ResNet-18/50,
ResNeXt, VGG-16, DenseNet-121, MobileNet V1/V2/V3, EfficientNet-B0, ConvNeXt-T, UNet, DeepLab ASPP,
ViT patch embedding, wav2vec2/TextCNN/TCN/QuartzNet 1-D convs; BERT tiny→large, GPT-2, ViT-Ti/S/B, T5,
LLaMA-style MLPs and attention, MLP-Mixer, DLRM and classifier heads; PTB/AWD/GNMT/speech LSTMs and GRUs;
vocabulary sizes of BERT/GPT-2/PTB/LLaMA) at an input resolution or sequence length people train at,
otherwise a log-uniform draw over a wide range. Shapes are kept CPU-feasible by halving the batch, then
the spatial size or sequence length, until the analytical training-step estimate
(:func:`estimate_train_ms`) is under ``max_train_ms``.

"Add points where the predictor is worst": :func:`propose_neighbours` takes configurations with their
prediction errors and returns perturbed neighbours of the worst ones (batch, channels/features, spatial
size or sequence length scaled by 0.5-2x), to be profiled next (``run --refine-from``).

Torch-free: the API, the trainer and the tests import this module without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.costs import gemm_dims, layer_cost, optimizer_update_cost
from app.core.ir import GemmAttrs, Layer, OpKind, Tensor
from app.core.json_import import import_json

#: Relative sampling weight of each family (also the list of valid ``--families``).
FAMILY_WEIGHTS: dict[str, float] = {
    "conv2d": 15, "conv2d_depthwise": 6, "conv2d_grouped": 3, "conv1d": 3,
    "linear": 14, "matmul": 6, "attention": 4, "lstm": 5, "gru": 4,
    "batchnorm": 6, "layernorm": 5, "groupnorm": 2, "instancenorm": 1,
    "maxpool": 3, "avgpool": 2, "global_pool": 2,
    "activation": 8, "softmax": 3, "embedding": 4, "dropout": 1,
}

#: IR kind of the (main) layer of each family.
FAMILY_KIND: dict[str, OpKind] = {
    "conv2d": OpKind.CONV, "conv2d_depthwise": OpKind.CONV, "conv2d_grouped": OpKind.CONV,
    "conv1d": OpKind.CONV, "linear": OpKind.GEMM, "matmul": OpKind.MATMUL, "attention": OpKind.MATMUL,
    "lstm": OpKind.RECURRENT, "gru": OpKind.RECURRENT, "batchnorm": OpKind.BATCHNORM,
    "layernorm": OpKind.NORM, "groupnorm": OpKind.NORM, "instancenorm": OpKind.NORM,
    "maxpool": OpKind.POOL, "avgpool": OpKind.POOL, "global_pool": OpKind.GLOBAL_POOL,
    "activation": OpKind.ACTIVATION, "softmax": OpKind.SOFTMAX, "embedding": OpKind.EMBEDDING,
    "dropout": OpKind.DROPOUT,
}

#: Optimizers drawn for layers with parameters (weights); param-free layers get ``"none"``.
OPTIMIZER_WEIGHTS: dict[str, float] = {"sgd": 3, "momentum": 3, "adam": 4}

#: Default cap on the estimated training step of one layer (ms, on the reference CPU of
#: :func:`estimate_train_ms`): keeps the campaign near 0.5 s per configuration.
DEFAULT_MAX_TRAIN_MS = 30.0

# Reference throughput of the estimate (one AVX-512 core, fp32, measured on the seed machine:
# ~55 GFLOP/s on 512² GEMMs; ~6 GB/s effective for streaming kernels incl. allocation).
_EST_FLOPS_PER_S = 45e9
_EST_BYTES_PER_S = 6e9
_EST_OVERHEAD_S = 60e-6  # per layer and pass (framework dispatch)


# --------------------------------------------------------------------------------------------------
# The configuration record
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerConfig:
    """One layer at one batch size (see module docstring).

    ``input_shape`` is one sample's input without the batch axis (JSON layer-list convention,
    channels-first); ``spec`` the JSON layer spec (``None`` for matmul/attention); ``shapes`` the
    explicit shape record of matmul (``{"a": [..], "b": [..]}`` full shapes, batch axis first) or
    attention (``{"heads", "seq_q", "seq_kv", "head_dim", "causal"}``). ``needs_input_grad`` is
    whether the measured input requires a gradient (an inner layer; the IR built by ``import_json``
    marks a graph's first layer False, :meth:`to_layers` overrides it). ``optimizer`` is the update
    rule timed with it and ``origin`` where it came from (``"resnet50"``, ``"uniform"``,
    ``"refine:<parent id>"``): neither is part of :attr:`config_id`.
    """

    family: str
    op: str
    batch_size: int
    input_shape: tuple[int, ...] = ()
    spec: Mapping[str, Any] | None = None
    shapes: Mapping[str, Any] | None = None
    needs_input_grad: bool = True
    optimizer: str = "none"
    origin: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def identity(self) -> dict[str, Any]:
        """The fields that define the configuration (what :attr:`config_id` hashes)."""
        d: dict[str, Any] = {
            "family": self.family, "op": self.op, "batch_size": self.batch_size,
            "input_shape": list(self.input_shape), "spec": dict(self.spec) if self.spec else None,
            "shapes": dict(self.shapes) if self.shapes else None,
        }
        if not self.needs_input_grad and self.op != "embedding":
            d["needs_input_grad"] = False
        return d

    @property
    def config_id(self) -> str:
        """Stable 16-hex-digit id: SHA-1 of the canonical JSON of :meth:`identity`."""
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return self.family + "-" + hashlib.sha1(blob.encode()).hexdigest()[:16]

    @property
    def kind(self) -> OpKind:
        """IR kind of the main layer."""
        return FAMILY_KIND[self.family]

    def graph_doc(self, precision: str = "fp32") -> dict[str, Any] | None:
        """The one-layer JSON graph document, or ``None`` for matmul/attention (use ``shapes``)."""
        if self.spec is None:
            return None
        dtype = "int64" if self.op == "embedding" else _DTYPE[precision]
        return {"input_shape": list(self.input_shape), "input_dtype": dtype, "layers": [dict(self.spec)]}

    def to_layers(self, precision: str = "fp32") -> tuple[Layer, ...]:
        """The IR layers of this configuration at its batch size.

        JSON-describable families: ``import_json(graph_doc, batch_size=batch_size)`` with the
        ``needs_input_grad`` set from the config. Matmul: one ``MatMul`` layer (kind MATMUL,
        :class:`~app.core.ir.GemmAttrs`). Attention (``scaled_dot_product_attention``): ``MatMul`` (Q·Kᵀ), ``Softmax``,
        ``MatMul`` (P·V). Raises :class:`app.errors.InvalidGraph` for an invalid spec and ``ValueError``
        for a malformed shape record.
        """
        dt = _DTYPE[precision]
        doc = self.graph_doc(precision)
        if doc is not None:
            g = import_json(doc, batch_size=self.batch_size)
            nig = self.needs_input_grad and self.op != "embedding"
            return tuple(replace(layer, needs_input_grad=nig) for layer in g.layers)
        s = dict(self.shapes or {})
        if self.op == "matmul":
            a, b = tuple(s["a"]), tuple(s["b"])
            if len(a) < 2 or len(b) < 2 or a[:-2] != b[:-2] or a[-1] != b[-2]:
                raise ValueError(f"matmul shapes do not chain: {a} @ {b}")
            out = (*a[:-1], b[-1])
            return (_matmul_layer("matmul", a, b, out, dt, self.needs_input_grad),)
        if self.op == "attention":
            bsz, h, sq, skv, d = self.batch_size, s["heads"], s["seq_q"], s["seq_kv"], s["head_dim"]
            if min(bsz, h, sq, skv, d) <= 0:
                raise ValueError(f"attention shape record must be positive: {s}")
            q, kt, p, v = (bsz, h, sq, d), (bsz, h, d, skv), (bsz, h, sq, skv), (bsz, h, skv, d)
            qk = _matmul_layer("attn.qk", q, kt, p, dt, self.needs_input_grad)
            sm = Layer("attn.softmax", "Softmax", OpKind.SOFTMAX, (Tensor("attn.qk.out", p, dt),),
                       (Tensor("attn.softmax.out", p, dt),))
            pv = _matmul_layer("attn.pv", p, v, (bsz, h, sq, d), dt, True)
            return (qk, sm, pv)
        raise ValueError(f"no graph spec and unknown op {self.op!r}")

    def params(self) -> int:
        """Trainable parameters of the configuration."""
        return sum(layer.params for layer in self.to_layers())

    def row_fields(self, precision: str = "fp32") -> dict[str, Any]:
        """The configuration part of a profiler row (see :mod:`app.profiler.run`)."""
        return {
            "config_id": self.config_id, "family": self.family, "op": self.op,
            "op_kind": self.kind.value, "origin": self.origin, "batch_size": self.batch_size,
            "input_shape": list(self.input_shape) if self.spec is not None else None,
            "graph": self.graph_doc(precision), "shapes": dict(self.shapes) if self.shapes else None,
            "needs_input_grad": self.needs_input_grad and self.op != "embedding",
            "optimizer": self.optimizer,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LayerConfig:
        """Rebuild the configuration of a profiler row (inverse of :meth:`row_fields`)."""
        graph = row.get("graph")
        spec = graph["layers"][0] if graph else None
        shape = tuple(graph["input_shape"]) if graph else ()
        return cls(
            family=row["family"], op=row["op"], batch_size=int(row["batch_size"]), input_shape=shape,
            spec=spec, shapes=row.get("shapes"), needs_input_grad=bool(row.get("needs_input_grad", True)),
            optimizer=row.get("optimizer", "none"), origin=row.get("origin", ""),
        )


_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _matmul_layer(name: str, a: Sequence[int], b: Sequence[int], out: Sequence[int], dt: str, nig: bool) -> Layer:
    batch, m, n, k = gemm_dims(tuple(a), tuple(b))
    return Layer(
        name, "MatMul", OpKind.MATMUL,
        (Tensor(f"{name}.a", tuple(a), dt), Tensor(f"{name}.b", tuple(b), dt)),
        (Tensor(f"{name}.out", tuple(out), dt),),
        attrs=GemmAttrs(m=m, n=n, k=k, batch=batch), needs_input_grad=nig,
    )


def estimate_train_ms(config: LayerConfig) -> float:
    """Rough single-core CPU time of one training step (forward + backward + update), ms.

    From :func:`app.core.costs.layer_cost`: FLOPs / 45 GFLOP/s + bytes / 6 GB/s + 60 µs per layer and
    pass; recurrent layers ×2 (small sequential GEMMs run far below peak). Used only to keep sampled
    shapes CPU-feasible, never as a prediction.
    """
    total = 0.0
    for layer in config.to_layers():
        c = layer_cost(layer)
        upd_flops, upd_bytes = optimizer_update_cost(c.params, config.optimizer)
        flops = c.forward_flops + c.backward_flops + upd_flops
        nbytes = c.forward_bytes + c.backward_bytes + upd_bytes
        t = flops / _EST_FLOPS_PER_S + nbytes / _EST_BYTES_PER_S + 3 * _EST_OVERHEAD_S
        total += 2 * t if layer.kind is OpKind.RECURRENT else t
    return total * 1e3


# --------------------------------------------------------------------------------------------------
# Architecture catalogs (shapes at the reference input resolution of each network)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Conv:
    arch: str
    c_in: int
    c_out: int
    k: int
    s: int
    hw: int  # input spatial side (or length for 1-D) at the reference resolution
    groups: int = 1
    bias: bool = False
    dil: int = 1
    pad: int | None = None  # None: "same"-style d*(k-1)//2
    ref: int = 224
    act: str = "relu"

    @property
    def padding(self) -> int:
        return self.dil * (self.k - 1) // 2 if self.pad is None else self.pad


def _resnet(arch: str, blocks: Sequence[int], *, bottleneck: bool, groups: int = 1, width: int = 64,
            ref: int = 224, stem: bool = True) -> list[_Conv]:
    out: list[_Conv] = []
    hw, c = (112, 64) if ref == 224 else (ref, 16)
    if stem and ref == 224:
        out.append(_Conv(arch, 3, 64, 7, 2, 224))
        hw = 56
    elif stem:
        out.append(_Conv(arch, 3, 16, 3, 1, ref, ref=ref))
    base = 64 if ref == 224 else 16
    for stage, n in enumerate(blocks):
        planes = base * 2**stage
        mid = planes * width // 64 * groups if bottleneck else planes
        c_out = planes * 4 if bottleneck else planes
        for i in range(n):
            s = 2 if (i == 0 and stage > 0) else 1
            if bottleneck:
                out.append(_Conv(arch, c, mid, 1, 1, hw, ref=ref))
                out.append(_Conv(arch, mid, mid, 3, s, hw, groups=groups, ref=ref))
                out.append(_Conv(arch, mid, c_out, 1, 1, hw // s, ref=ref))
            else:
                out.append(_Conv(arch, c, planes, 3, s, hw, ref=ref))
                out.append(_Conv(arch, planes, planes, 3, 1, hw // s, ref=ref))
            if i == 0 and (s != 1 or c != c_out):
                out.append(_Conv(arch, c, c_out, 1, s, hw, ref=ref))
            hw //= s
            c = c_out
    return out


def _vgg16() -> list[_Conv]:
    cfg = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
           (256, 512, 28), (512, 512, 28), (512, 512, 14)]
    return [_Conv("vgg16", a, b, 3, 1, hw, bias=True) for a, b, hw in cfg]


def _densenet121() -> list[_Conv]:
    out = [_Conv("densenet121", 3, 64, 7, 2, 224)]
    c, hw = 64, 56
    for bi, n in enumerate((6, 12, 24, 16)):
        for i in range(n):
            out.append(_Conv("densenet121", c + 32 * i, 128, 1, 1, hw))
            out.append(_Conv("densenet121", 128, 32, 3, 1, hw))
        c += 32 * n
        if bi < 3:
            out.append(_Conv("densenet121", c, c // 2, 1, 1, hw))
            c, hw = c // 2, hw // 2
    return out


def _mobilenet_v1() -> list[_Conv]:
    out = [_Conv("mobilenet_v1", 3, 32, 3, 2, 224)]
    cfg = [(32, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 512, 2),
           *[(512, 512, 1)] * 5, (512, 1024, 2), (1024, 1024, 1)]
    hw = 112
    for c_in, c_out, s in cfg:
        out.append(_Conv("mobilenet_v1", c_in, c_in, 3, s, hw, groups=c_in))
        hw //= s
        out.append(_Conv("mobilenet_v1", c_in, c_out, 1, 1, hw))
    return out


def _mobilenet_v2() -> list[_Conv]:
    a = "mobilenet_v2"
    out = [_Conv(a, 3, 32, 3, 2, 224)]
    c, hw = 32, 112
    for t, c_out, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                           (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            st = s if i == 0 else 1
            hid = c * t
            if t != 1:
                out.append(_Conv(a, c, hid, 1, 1, hw))
            out.append(_Conv(a, hid, hid, 3, st, hw, groups=hid))
            hw //= st
            out.append(_Conv(a, hid, c_out, 1, 1, hw))
            c = c_out
    out.append(_Conv(a, 320, 1280, 1, 1, 7))
    return out


def _mobilenet_v3() -> list[_Conv]:
    a = "mobilenet_v3_large"
    cfg = [(16, 16, 16, 3, 1, 112), (16, 64, 24, 3, 2, 112), (24, 72, 24, 3, 1, 56), (24, 72, 40, 5, 2, 56),
           (40, 120, 40, 5, 1, 28), (40, 240, 80, 3, 2, 28), (80, 200, 80, 3, 1, 14), (80, 184, 80, 3, 1, 14),
           (80, 480, 112, 3, 1, 14), (112, 672, 112, 3, 1, 14), (112, 672, 160, 5, 2, 14),
           (160, 960, 160, 5, 1, 7)]
    out = [_Conv(a, 3, 16, 3, 2, 224, act="hardswish")]
    for c, e, o, k, s, hw in cfg:
        if e != c:
            out.append(_Conv(a, c, e, 1, 1, hw, act="hardswish"))
        out.append(_Conv(a, e, e, k, s, hw, groups=e, act="hardswish"))
        out.append(_Conv(a, e, o, 1, 1, hw // s, act="hardswish"))
    return out


def _efficientnet_b0() -> list[_Conv]:
    a = "efficientnet_b0"
    out = [_Conv(a, 3, 32, 3, 2, 224, act="silu")]
    c, hw = 32, 112
    for e, k, s, c_out, n in ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                              (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)):
        for i in range(n):
            st = s if i == 0 else 1
            hid = c * e
            if e != 1:
                out.append(_Conv(a, c, hid, 1, 1, hw, act="silu"))
            out.append(_Conv(a, hid, hid, k, st, hw, groups=hid, act="silu"))
            hw //= st
            se = max(1, c // 4)
            out.append(_Conv(a, hid, se, 1, 1, 1, bias=True, act="silu"))  # squeeze-excitation
            out.append(_Conv(a, se, hid, 1, 1, 1, bias=True, act="sigmoid"))
            out.append(_Conv(a, hid, c_out, 1, 1, hw, act="silu"))
            c = c_out
    out.append(_Conv(a, 320, 1280, 1, 1, 7, act="silu"))
    return out


def _convnext_t() -> list[_Conv]:
    a = "convnext_t"
    out = [_Conv(a, 3, 96, 4, 4, 224, bias=True, pad=0, act="gelu")]
    for i, (d, hw) in enumerate(((96, 56), (192, 28), (384, 14), (768, 7))):
        out.append(_Conv(a, d, d, 7, 1, hw, groups=d, bias=True, act="gelu"))
        if i:
            out.append(_Conv(a, d // 2, d, 2, 2, hw * 2, bias=True, pad=0, act="gelu"))
    return out


def _misc_2d() -> list[_Conv]:
    out = []
    for c_in, c_out, hw in ((3, 64, 256), (64, 64, 256), (64, 128, 128), (128, 128, 128), (128, 256, 64),
                            (256, 256, 64), (256, 512, 32), (512, 512, 32), (512, 1024, 16),
                            (1024, 512, 32), (512, 256, 64), (256, 128, 128), (128, 64, 256)):
        out.append(_Conv("unet", c_in, c_out, 3, 1, hw, ref=256))
    for d in (6, 12, 18):  # DeepLabv3 ASPP on ResNet-50 features (output stride 8)
        out.append(_Conv("deeplabv3", 2048, 256, 3, 1, 28, dil=d))
    out.append(_Conv("deeplabv3", 2048, 256, 1, 1, 28))
    for c_out in (192, 384, 768):  # ViT patch embedding (16x16, stride 16)
        out.append(_Conv("vit_patch", 3, c_out, 16, 16, 224, bias=True, pad=0))
    for c_in, c_out, hw in ((3, 32, 416), (32, 64, 416), (64, 128, 208), (128, 256, 104), (256, 512, 52),
                            (512, 1024, 26)):  # YOLOv3 darknet (3x3 stride-2 downsampling)
        out.append(_Conv("darknet53", c_in, c_out, 3, 2 if c_in > 3 else 1, hw, ref=416, act="leaky_relu"))
    for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        out.append(_Conv("resnet_dilated", c, c, 3, 1, hw, dil=2))
    return out


def _grouped() -> list[_Conv]:
    out = [c for c in _resnet("resnext50_32x4d", (3, 4, 6, 3), bottleneck=True, groups=32, width=4)
           if c.groups > 1]
    out += [c for c in _resnet("resnext101_32x8d", (3, 4, 23, 3), bottleneck=True, groups=32, width=8)
            if c.groups > 1]
    out += [_Conv("alexnet", 48 * 2, 256, 5, 1, 27, groups=2, bias=True),
            _Conv("alexnet", 384, 384, 3, 1, 13, groups=2, bias=True),
            _Conv("alexnet", 384, 256, 3, 1, 13, groups=2, bias=True)]
    for w, g, hw in ((48, 6, 56), (104, 13, 28), (208, 26, 14), (440, 55, 7)):  # RegNetY-400MF
        out.append(_Conv("regnety_400mf", w, w, 3, 1, hw, groups=g))
    for c, hw in ((240, 28), (480, 14), (960, 7)):  # ShuffleNet v1 g=3 pointwise group convs
        out.append(_Conv("shufflenet_g3", c, c // 4, 1, 1, hw, groups=3))
        out.append(_Conv("shufflenet_g3", c // 4, c, 1, 1, hw, groups=3))
    return out


def _conv1d() -> list[_Conv]:
    out = [_Conv("wav2vec2", 1, 512, 10, 5, 16000, pad=0, ref=16000, act="gelu")]
    length = 3199
    for k in (3, 3, 3, 3, 2, 2):
        out.append(_Conv("wav2vec2", 512, 512, k, 2, length, pad=0, ref=16000, act="gelu"))
        length = (length - k) // 2 + 1
    for k in (3, 4, 5):  # Kim 2014 TextCNN on 300-d embeddings
        out.append(_Conv("textcnn", 300, 100, k, 1, 400, pad=0, bias=True, ref=400))
    for c in (32, 64, 128, 256):  # TCN / WaveNet dilated convs
        for d in (1, 2, 4, 8, 16, 32):
            out.append(_Conv("tcn", c, c, 3, 1, 1024, dil=d, bias=True, ref=1024))
    for c, k in ((256, 33), (256, 39), (512, 51), (512, 63), (512, 75), (512, 87)):  # QuartzNet
        out.append(_Conv("quartznet", c, c, k, 1, 800, groups=c, ref=800))
        out.append(_Conv("quartznet", c, c, 1, 1, 800, ref=800))
    return out


_CONV_2D: list[_Conv] = [
    *_resnet("resnet18", (2, 2, 2, 2), bottleneck=False),
    *_resnet("resnet50", (3, 4, 6, 3), bottleneck=True),
    *_resnet("resnet20_cifar", (3, 3, 3), bottleneck=False, ref=32),
    *_vgg16(), *_densenet121(), *_mobilenet_v1(), *_mobilenet_v2(), *_mobilenet_v3(),
    *_efficientnet_b0(), *_convnext_t(), *_misc_2d(), *_grouped(),
]
_CONV_DENSE = [c for c in _CONV_2D if c.groups == 1]
_CONV_DW = [c for c in _CONV_2D if c.groups > 1 and c.groups == c.c_in]
_CONV_GROUPED = [c for c in _CONV_2D if 1 < c.groups < c.c_in]
_CONV_1D = _conv1d()


@dataclass(frozen=True)
class _Transformer:
    arch: str
    hidden: int
    ffn: int
    heads: int
    seqs: tuple[int, ...]
    causal: bool = False
    fused_qkv: bool = False
    act: str = "gelu"
    vocab: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_TRANSFORMERS: list[_Transformer] = [
    _Transformer("bert_tiny", 128, 512, 2, (64, 128, 256, 512), vocab=30522),
    _Transformer("bert_mini", 256, 1024, 4, (64, 128, 256, 512), vocab=30522),
    _Transformer("bert_small", 512, 2048, 8, (64, 128, 256, 512), vocab=30522),
    _Transformer("bert_base", 768, 3072, 12, (32, 64, 128, 256, 384, 512), vocab=30522),
    _Transformer("bert_large", 1024, 4096, 16, (64, 128, 256, 512), vocab=30522),
    _Transformer("gpt2", 768, 3072, 12, (64, 128, 256, 512, 1024), causal=True, fused_qkv=True, vocab=50257),
    _Transformer("gpt2_medium", 1024, 4096, 16, (128, 256, 512, 1024), causal=True, fused_qkv=True),
    _Transformer("vit_ti16", 192, 768, 3, (197, 65, 50), fused_qkv=True),
    _Transformer("vit_s16", 384, 1536, 6, (197, 65, 50), fused_qkv=True),
    _Transformer("vit_b16", 768, 3072, 12, (197, 65, 50), fused_qkv=True),
    _Transformer("t5_small", 512, 2048, 8, (64, 128, 256, 512), act="relu", vocab=32128),
    _Transformer("llama_small", 512, 1376, 8, (128, 256, 512, 1024), causal=True, act="silu", vocab=32000),
    _Transformer("llama_1b", 2048, 5632, 32, (64, 128, 256, 512), causal=True, act="silu", vocab=32000),
    _Transformer("llama_7b_head", 4096, 11008, 32, (16, 32, 64), causal=True, act="silu"),
]

# (arch, in_features, out_features) of layers applied to one vector per sample.
_HEADS: list[tuple[str, int, int]] = [
    ("resnet18", 512, 1000), ("resnet50", 2048, 1000), ("mobilenet_v2", 1280, 1000),
    ("densenet121", 1024, 1000), ("vit_b16", 768, 1000), ("vgg16", 4096, 4096), ("vgg16", 4096, 1000),
    ("cifar", 512, 10), ("cifar", 512, 100), ("lenet5", 400, 120), ("lenet5", 120, 84), ("lenet5", 84, 10),
    ("mnist_mlp", 784, 256), ("mnist_mlp", 256, 128), ("mnist_mlp", 128, 10), ("bert_base", 768, 768),
    ("bert_base", 768, 2), ("dlrm", 13, 512), ("dlrm", 512, 256), ("dlrm", 256, 64), ("dlrm", 479, 1024),
    ("dlrm", 1024, 1024), ("dlrm", 1024, 512), ("dlrm", 256, 1), ("autoencoder", 784, 1000),
    ("autoencoder", 1000, 500), ("autoencoder", 500, 250), ("autoencoder", 250, 30),
    ("mobilenet_v3_large", 960, 1280), ("efficientnet_b0", 1280, 1000),
]

# (arch, in_features, out_features, sequence lengths) of per-token layers outside transformer blocks.
_TOKEN_LINEARS: list[tuple[str, int, int, tuple[int, ...]]] = [
    ("ptb_lstm_small", 200, 10000, (20, 35)), ("ptb_lstm_medium", 650, 10000, (35,)),
    ("awd_lstm", 400, 33278, (70,)), ("bert_mini_mlm", 256, 30522, (128,)),
    ("gnmt", 1024, 32000, (32,)), ("mixer_s16", 512, 2048, (196,)), ("mixer_s16", 2048, 512, (196,)),
    ("mixer_s16_token", 196, 256, (512,)), ("mixer_s16_token", 256, 196, (512,)),
    ("convnext_t", 96, 384, (3136, 784, 196)), ("convnext_t", 384, 96, (3136, 784, 196)),
    ("convnext_t", 192, 768, (784, 196, 49)), ("convnext_t", 384, 1536, (196, 49)),
    ("convnext_t", 768, 3072, (49, 16)), ("wav2vec2_proj", 512, 768, (49, 99, 199)),
]


@dataclass(frozen=True)
class _Rnn:
    arch: str
    cell: str
    input_size: int
    hidden: int
    seqs: tuple[int, ...]
    bidirectional: bool = False


_RNNS: list[_Rnn] = [
    _Rnn("ptb_small", "lstm", 200, 200, (20, 35)), _Rnn("ptb_medium", "lstm", 650, 650, (35,)),
    _Rnn("ptb_large", "lstm", 1500, 1500, (35,)), _Rnn("awd_lstm", "lstm", 400, 1150, (70,)),
    _Rnn("awd_lstm", "lstm", 1150, 1150, (70,)), _Rnn("awd_lstm", "lstm", 1150, 400, (70,)),
    _Rnn("gnmt", "lstm", 1024, 1024, (25, 50)), _Rnn("seq2seq", "lstm", 256, 512, (20, 30, 50)),
    _Rnn("char_rnn", "lstm", 64, 512, (100, 200)), _Rnn("speech_lstm", "lstm", 80, 320, (100, 200, 400)),
    _Rnn("speech_blstm", "lstm", 40, 256, (100, 300), True),
    _Rnn("sentiment", "lstm", 300, 128, (50, 200), True),
    _Rnn("sentiment", "lstm", 300, 256, (50, 100, 200), True), _Rnn("elmo", "lstm", 512, 4096, (20,)),
    _Rnn("deepspeech2", "gru", 1312, 800, (50, 100), True),
    _Rnn("deepspeech2", "gru", 1600, 800, (50, 100), True),
    _Rnn("gru4rec", "gru", 100, 100, (10, 20)), _Rnn("gru4rec", "gru", 300, 300, (10, 20)),
    _Rnn("speech_gru", "gru", 80, 256, (100, 200, 400)), _Rnn("speech_gru", "gru", 256, 768, (100, 200)),
    _Rnn("seq2seq", "gru", 256, 512, (20, 30, 50)), _Rnn("char_gru", "gru", 64, 512, (100,)),
]

# (arch, vocabulary, embedding dim, sequence lengths)
_EMBEDDINGS: list[tuple[str, int, int, tuple[int, ...]]] = [
    ("bert_base", 30522, 768, (64, 128, 256, 512)), ("bert_mini", 30522, 256, (128, 512)),
    ("bert_tiny", 30522, 128, (128, 512)), ("bert_pos", 512, 768, (128, 512)), ("bert_type", 2, 768, (128,)),
    ("gpt2", 50257, 768, (128, 512, 1024)), ("gpt2_pos", 1024, 768, (512, 1024)),
    ("gpt2_small_d", 50257, 256, (128,)),
    ("ptb", 10000, 200, (20, 35)), ("ptb", 10000, 650, (35,)), ("awd_lstm", 33278, 400, (70,)),
    ("llama", 32000, 512, (128, 512)), ("llama_1b", 32000, 2048, (64, 128)), ("t5_small", 32128, 512, (128,)),
    ("char", 100, 64, (100, 200)), ("word2vec", 100000, 300, (5, 50)), ("dlrm", 100000, 64, (1, 26)),
]

_ACT_OPS = ("relu", "gelu", "sigmoid", "tanh", "silu", "leaky_relu", "elu", "hardswish", "softplus", "mish")
_RESOLUTIONS: tuple[tuple[int, float], ...] = (
    (224, 2), (192, 1), (160, 2), (128, 3), (112, 2), (96, 2), (64, 2), (32, 1),
)
_CNN_BATCHES: tuple[tuple[int, float], ...] = ((1, 3), (2, 2), (4, 2), (8, 2), (16, 2), (32, 1), (64, 1))
_SEQ_BATCHES: tuple[tuple[int, float], ...] = ((1, 3), (2, 2), (4, 2), (8, 2), (16, 1), (32, 1))
_VEC_BATCHES: tuple[tuple[int, float], ...] = (
    (1, 2), (8, 1), (16, 1), (32, 2), (64, 2), (128, 2), (256, 1), (512, 1),
)


# --------------------------------------------------------------------------------------------------
# Family samplers: each returns (origin, initial batch, build(batch, shrink) -> LayerConfig | None)
# --------------------------------------------------------------------------------------------------

_Build = Callable[[int, int], "LayerConfig | None"]
_Recipe = tuple[str, int, _Build]


def _wchoice(rng: random.Random, pairs: Sequence[tuple[Any, float]]) -> Any:
    return rng.choices([p[0] for p in pairs], weights=[p[1] for p in pairs])[0]


def _logu(rng: random.Random, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def _out_size(size: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _scaled(hw: int, ref: int, res: int, shrink: int) -> int:
    return max(1, round(hw * res / ref)) >> shrink if hw > 1 else 1


def _pick_res(rng: random.Random, ref: int) -> int:
    if ref == 224:
        return _wchoice(rng, _RESOLUTIONS)
    return ref if rng.random() < 0.5 else rng.choice((ref // 2, ref // 4, ref))


def _conv_build(family: str, c: _Conv, res: int, nd: int) -> _Build:
    def build(batch: int, shrink: int) -> LayerConfig | None:
        hw = _scaled(c.hw, c.ref, res, shrink)
        if hw < 1 or _out_size(hw, c.k, c.s, c.padding, c.dil) < 1:
            return None
        spec: dict[str, Any] = {"op": "conv1d" if nd == 1 else "conv2d", "out_channels": c.c_out, "kernel_size": c.k,
                "stride": c.s, "padding": c.padding, "dilation": c.dil, "groups": c.groups, "bias": c.bias}
        return LayerConfig(family, spec["op"], batch, (c.c_in, *([hw] * nd)), spec)
    return build


def _sample_conv(rng: random.Random, family: str, uniform: bool) -> _Recipe:
    nd = 1 if family == "conv1d" else 2
    if uniform:
        c_in = _logu(rng, 1, 1024)
        k = rng.choice((1, 3, 3, 5, 7) if nd == 2 else (1, 3, 5, 9, 15))
        s = rng.choice((1, 1, 2))
        if family == "conv2d_depthwise" or (family == "conv1d" and rng.random() < 0.2):
            c_out, g = c_in, c_in
        elif family == "conv2d_grouped":
            g = rng.choice((2, 4, 8, 16, 32))
            c_in, c_out = g * _logu(rng, 1, 64), g * _logu(rng, 1, 64)
        else:
            c_out, g = _logu(rng, 1, 1024), 1
        hw = _logu(rng, max(k, 4), 128 if nd == 2 else 4096)
        c = _Conv("uniform", c_in, c_out, k, s, hw, groups=g, bias=rng.random() < 0.5, ref=hw)
        return "uniform", _wchoice(rng, _CNN_BATCHES), _conv_build(family, c, hw, nd)
    pool = {"conv2d": _CONV_DENSE, "conv2d_depthwise": _CONV_DW, "conv2d_grouped": _CONV_GROUPED,
            "conv1d": _CONV_1D}[family]
    c = rng.choice(pool)
    res = _pick_res(rng, c.ref)
    return c.arch, _wchoice(rng, _CNN_BATCHES), _conv_build(family, c, res, nd)


def _conv_feature_map(rng: random.Random, uniform: bool) -> tuple[str, int, int, int]:
    """(arch, channels, spatial side, reference) of a real conv layer's output (or a uniform draw)."""
    if uniform:
        return "uniform", _logu(rng, 1, 2048), _logu(rng, 1, 128), 0
    c = rng.choice(_CONV_2D)
    res = _pick_res(rng, c.ref)
    hw = max(1, round(c.hw * res / c.ref))
    return c.arch, c.c_out, max(1, _out_size(hw, c.k, c.s, c.padding, c.dil)), 1


def _token_shape(rng: random.Random, uniform: bool) -> tuple[str, int, int, _Transformer | None]:
    """(arch, sequence length, width, transformer) of a real transformer activation."""
    if uniform:
        return "uniform", _logu(rng, 1, 1024), _logu(rng, 8, 4096), None
    t = rng.choice(_TRANSFORMERS)
    return t.arch, rng.choice(t.seqs), rng.choice((t.hidden, t.hidden, t.ffn)), t


def _sample_linear(rng: random.Random, uniform: bool) -> _Recipe:
    if uniform:
        f_in, f_out = _logu(rng, 1, 8192), _logu(rng, 1, 8192)
        seq = rng.choice((None, None, _logu(rng, 1, 512)))
        origin = "uniform"
    else:
        r = rng.random()
        if r < 0.55:
            t = rng.choice(_TRANSFORMERS)
            shapes = [(t.hidden, t.hidden), (t.hidden, t.ffn), (t.ffn, t.hidden)]
            if t.fused_qkv:
                shapes.append((t.hidden, 3 * t.hidden))
            if t.act == "silu":
                shapes.append((t.hidden, t.hidden // 4))  # grouped-query k/v projections
            (f_in, f_out), seq, origin = rng.choice(shapes), rng.choice(t.seqs), t.arch
        elif r < 0.8:
            origin, f_in, f_out = rng.choice(_HEADS)
            seq = None
        else:
            origin, f_in, f_out, seqs = rng.choice(_TOKEN_LINEARS)
            seq = rng.choice(seqs)
    bias = rng.random() < 0.8 or uniform

    def build(batch: int, shrink: int) -> LayerConfig | None:
        spec = {"op": "linear", "out_features": f_out, "bias": bias}
        if seq is None:
            return None if shrink else LayerConfig("linear", "linear", batch, (f_in,), spec)
        s = seq >> shrink
        return LayerConfig("linear", "linear", batch, (s, f_in), spec) if s >= 1 else None

    return origin, _wchoice(rng, _SEQ_BATCHES if seq else _VEC_BATCHES), build


def _sample_matmul(rng: random.Random, uniform: bool) -> _Recipe:
    # ``shrinks`` marks which of (m, k, n) are sequence-like and get halved by a shrink step.
    if uniform:
        m, k, n = _logu(rng, 1, 1024), _logu(rng, 1, 1024), _logu(rng, 1, 1024)
        lead: tuple[int, ...] = rng.choice(((), (_logu(rng, 1, 16),)))
        origin, shrinks = "uniform", (True, False, True)
    else:
        t = rng.choice(_TRANSFORMERS)
        s, d = rng.choice(t.seqs), t.head_dim
        lead, origin = (t.heads,), t.arch
        if rng.random() < 0.5:  # Q·Kᵀ: (s, d) x (d, s)
            (m, k, n), shrinks = (s, d, s), (True, False, True)
        else:  # P·V: (s, s) x (s, d)
            (m, k, n), shrinks = (s, s, d), (True, True, False)

    def build(batch: int, shrink: int) -> LayerConfig | None:
        mm, kk, nn = (v >> shrink if f else v for v, f in zip((m, k, n), shrinks, strict=True))
        if min(mm, kk, nn) < 1:
            return None
        a, b = [batch, *lead, mm, kk], [batch, *lead, kk, nn]
        return LayerConfig("matmul", "matmul", batch, shapes={"a": a, "b": b})

    return origin, _wchoice(rng, _SEQ_BATCHES), build


def _sample_attention(rng: random.Random, uniform: bool) -> _Recipe:
    if uniform:
        h, d = _logu(rng, 1, 32), rng.choice((16, 32, 64, 80, 96, 128))
        sq = _logu(rng, 1, 1024)
        skv = sq if rng.random() < 0.7 else _logu(rng, 1, 1024)
        causal, origin = rng.random() < 0.3 and sq == skv, "uniform"
    else:
        t = rng.choice(_TRANSFORMERS)
        h, d, sq, origin = t.heads, t.head_dim, rng.choice(t.seqs), t.arch
        skv, causal = sq, t.causal
        if t.arch == "t5_small" and rng.random() < 0.4:  # decoder cross-attention
            sq = rng.choice((16, 32, 64))

    def build(batch: int, shrink: int) -> LayerConfig | None:
        q, kv = sq >> shrink, skv >> shrink
        if min(q, kv) < 1:
            return None
        shapes = {"heads": h, "seq_q": q, "seq_kv": kv, "head_dim": d, "causal": bool(causal and q == kv)}
        return LayerConfig("attention", "attention", batch, shapes=shapes)

    return origin, _wchoice(rng, _SEQ_BATCHES), build


def _sample_rnn(rng: random.Random, family: str, uniform: bool) -> _Recipe:
    if uniform:
        f_in, hid, seq = _logu(rng, 8, 1024), _logu(rng, 8, 1024), _logu(rng, 1, 200)
        bidir, origin = rng.random() < 0.25, "uniform"
    else:
        r = rng.choice([x for x in _RNNS if x.cell == family])
        f_in, hid, seq, bidir, origin = r.input_size, r.hidden, rng.choice(r.seqs), r.bidirectional, r.arch

    def build(batch: int, shrink: int) -> LayerConfig | None:
        s = seq >> shrink
        if s < 1:
            return None
        spec = {"op": family, "hidden_size": hid, "bidirectional": bidir}
        return LayerConfig(family, family, batch, (s, f_in), spec)

    return origin, _wchoice(rng, _SEQ_BATCHES), build


def _map_build(family: str, op: str, spec: dict[str, Any], ch: int, hw: int, nd: int = 2,
               min_hw: int = 1) -> _Build:
    def build(batch: int, shrink: int) -> LayerConfig | None:
        s = hw >> shrink
        if s < min_hw:
            return None
        return LayerConfig(family, op, batch, (ch, *([s] * nd)), spec)
    return build


def _tok_build(family: str, op: str, spec: dict[str, Any], seq: int, width: int,
               lead: tuple[int, ...] = ()) -> _Build:
    def build(batch: int, shrink: int) -> LayerConfig | None:
        s = seq >> shrink
        if s < 1:
            return None
        shape = (*lead, s, s) if width == -1 else (*lead, s, width)
        return LayerConfig(family, op, batch, shape, spec)
    return build


def _sample_norm(rng: random.Random, family: str, uniform: bool) -> _Recipe:
    if family == "layernorm":
        origin, seq, width, t = _token_shape(rng, uniform)
        if t is not None:  # LayerNorm normalises the model width
            width = t.hidden
        build = _tok_build(family, "layernorm", {"op": "layernorm"}, seq, width)
        return origin, _wchoice(rng, _SEQ_BATCHES), build
    if family == "batchnorm" and rng.random() < 0.1:
        origin, _, f = rng.choice(_HEADS)
        spec = {"op": "batchnorm"}
        return origin, _wchoice(rng, _VEC_BATCHES), lambda b, s: None if s else LayerConfig(
            "batchnorm", "batchnorm", b, (f,), spec)
    if family == "groupnorm":
        if uniform:
            g = rng.choice((1, 2, 4, 8, 16, 32))
            origin, ch, hw = "uniform", g * _logu(rng, 1, 64), _logu(rng, 1, 128)
        else:
            g = 32
            origin = rng.choice(("unet_ddpm", "sd_unet", "resnet50_gn"))
            ch = {"unet_ddpm": rng.choice((128, 256, 512)), "sd_unet": rng.choice((320, 640, 1280)),
                  "resnet50_gn": rng.choice((64, 128, 256, 512, 1024, 2048))}[origin]
            hw = rng.choice((64, 32, 16, 8)) if origin != "resnet50_gn" else rng.choice((56, 28, 14, 7))
        gn_spec: dict[str, Any] = {"op": "groupnorm", "num_groups": g}
        return origin, _wchoice(rng, _CNN_BATCHES), _map_build(family, "groupnorm", gn_spec, ch, hw)
    if family == "instancenorm":
        if uniform:
            origin, ch, hw = "uniform", _logu(rng, 1, 512), _logu(rng, 4, 256)
        else:
            origin, ch, hw = rng.choice((("style_transfer", 32, 256), ("style_transfer", 64, 128),
                                         ("style_transfer", 128, 64), ("cyclegan", 64, 256),
                                         ("cyclegan", 128, 128), ("cyclegan", 256, 64)))
            hw = max(1, hw * rng.choice((1, 1, 2, 4)) // 4)
        build = _map_build(family, "instancenorm", {"op": "instancenorm"}, ch, hw)
        return origin, _wchoice(rng, _CNN_BATCHES), build
    origin, ch, hw, _ = _conv_feature_map(rng, uniform)
    return origin, _wchoice(rng, _CNN_BATCHES), _map_build(family, "batchnorm", {"op": "batchnorm"}, ch, hw)


_POOLS_MAX: list[tuple[str, int, int, int, int, int]] = [  # arch, channels, hw, k, s, p
    ("resnet", 64, 112, 3, 2, 1), ("vgg16", 64, 224, 2, 2, 0), ("vgg16", 128, 112, 2, 2, 0),
    ("vgg16", 256, 56, 2, 2, 0), ("vgg16", 512, 28, 2, 2, 0), ("vgg16", 512, 14, 2, 2, 0),
    ("alexnet", 96, 55, 3, 2, 0), ("alexnet", 256, 27, 3, 2, 0), ("alexnet", 256, 13, 3, 2, 0),
    ("googlenet", 64, 112, 3, 2, 1), ("googlenet", 192, 56, 3, 2, 1), ("googlenet", 480, 28, 3, 2, 1),
    ("googlenet", 832, 14, 3, 2, 1), ("googlenet", 192, 28, 3, 1, 1), ("googlenet", 256, 28, 3, 1, 1),
    ("googlenet", 480, 14, 3, 1, 1), ("googlenet", 528, 14, 3, 1, 1), ("googlenet", 832, 7, 3, 1, 1),
    ("darknet", 64, 208, 2, 2, 0), ("darknet", 256, 52, 2, 2, 0), ("cifar", 64, 32, 2, 2, 0),
]
_POOLS_AVG: list[tuple[str, int, int, int, int, int]] = [
    ("densenet121", 128, 56, 2, 2, 0), ("densenet121", 256, 28, 2, 2, 0), ("densenet121", 512, 14, 2, 2, 0),
    ("inception_v3", 192, 35, 3, 1, 1), ("inception_v3", 256, 35, 3, 1, 1),
    ("inception_v3", 288, 35, 3, 1, 1), ("inception_v3", 768, 17, 3, 1, 1),
    ("inception_v3", 1280, 8, 3, 1, 1), ("inception_v3", 2048, 8, 3, 1, 1),
    ("resnet_d", 256, 56, 2, 2, 0), ("resnet_d", 512, 28, 2, 2, 0), ("resnet_d", 1024, 14, 2, 2, 0),
    ("lenet5", 6, 28, 2, 2, 0), ("lenet5", 16, 10, 2, 2, 0),
]


def _sample_pool(rng: random.Random, family: str, uniform: bool) -> _Recipe:
    if family == "global_pool":
        op = "global_avgpool" if rng.random() < 0.8 else "global_maxpool"
        if uniform or rng.random() < 0.5:
            origin, ch, hw, _ = _conv_feature_map(rng, uniform)
        else:
            origin, ch = rng.choice((("resnet18", 512), ("resnet50", 2048), ("mobilenet_v2", 1280),
                                     ("densenet121", 1024), ("efficientnet_b0", 1280), ("mobilenet_v3", 960)))
            hw = max(1, 7 * _pick_res(rng, 224) // 224)
        return origin, _wchoice(rng, _CNN_BATCHES), _map_build(family, op, {"op": op}, ch, hw)
    op = "maxpool" if family == "maxpool" else "avgpool"
    if uniform:
        k = rng.choice((2, 3, 3, 5))
        origin, ch, hw, p = "uniform", _logu(rng, 1, 1024), _logu(rng, k, 128), k // 2
        s = rng.choice((1, 2, 2))
    else:
        origin, ch, hw0, k, s, p = rng.choice(_POOLS_MAX if family == "maxpool" else _POOLS_AVG)
        hw = max(k, round(hw0 * rng.choice((1.0, 1.0, 0.75, 0.5, 0.25))))
    spec = {"op": op, "kernel_size": k, "stride": s, "padding": p}
    return origin, _wchoice(rng, _CNN_BATCHES), _map_build(family, op, spec, ch, hw, min_hw=max(k, 2 * p + 1))


def _sample_activation(rng: random.Random, family: str, uniform: bool) -> _Recipe:
    if uniform:
        op = rng.choice(_ACT_OPS)
    r = rng.random()
    if family == "dropout" or r < 0.4:
        origin, seq, width, t = _token_shape(rng, uniform)
        if not uniform:
            op = t.act if (t is not None and family == "activation") else "gelu"
        spec = {"op": "dropout" if family == "dropout" else op}
        if family == "dropout" and t is not None and rng.random() < 0.3:  # attention-probability dropout
            build = _tok_build(family, "dropout", spec, seq, -1, (t.heads,))
            return origin, _wchoice(rng, _SEQ_BATCHES), build
        return origin, _wchoice(rng, _SEQ_BATCHES), _tok_build(family, spec["op"], spec, seq, width)
    if r < 0.5:  # gates (LSTM-style) or SE sigmoid
        origin, ch = rng.choice((("efficientnet_se", rng.choice((96, 144, 240, 480, 672, 1152))),
                                 ("mobilenet_v3_se", rng.choice((72, 120, 480, 672, 960)))))
        op = op if uniform else "sigmoid"
        return origin, _wchoice(rng, _CNN_BATCHES), _map_build(family, op, {"op": op}, ch, 1)
    if uniform:
        origin, ch, hw, _ = _conv_feature_map(rng, True)
    else:
        c = rng.choice(_CONV_2D)
        res = _pick_res(rng, c.ref)
        hw = max(1, _out_size(max(1, round(c.hw * res / c.ref)), c.k, c.s, c.padding, c.dil))
        origin, ch, op = c.arch, c.c_out, c.act
    return origin, _wchoice(rng, _CNN_BATCHES), _map_build(family, op, {"op": op}, ch, hw)


def _sample_softmax(rng: random.Random, uniform: bool) -> _Recipe:
    spec = {"op": "softmax"}
    r = rng.random()
    if uniform:
        build = _tok_build("softmax", "softmax", spec, _logu(rng, 1, 1024), _logu(rng, 2, 32768))
        return "uniform", _wchoice(rng, _SEQ_BATCHES), build
    if r < 0.6:  # attention probabilities (heads, seq, seq)
        t = rng.choice(_TRANSFORMERS)
        build = _tok_build("softmax", "softmax", spec, rng.choice(t.seqs), -1, (t.heads,))
        return t.arch, _wchoice(rng, _SEQ_BATCHES), build
    if r < 0.8:  # classifier
        origin, classes = rng.choice((("imagenet", 1000), ("cifar10", 10), ("cifar100", 100),
                                      ("imagenet21k", 21843)))
        return origin, _wchoice(rng, _VEC_BATCHES), lambda b, s: None if s else LayerConfig(
            "softmax", "softmax", b, (classes,), spec)
    origin, vocab, seqs = rng.choice((("ptb", 10000, (20, 35)), ("bert", 30522, (32, 128)),
                                      ("gpt2", 50257, (16, 64, 128)), ("llama", 32000, (32, 128))))
    build = _tok_build("softmax", "softmax", spec, rng.choice(seqs), vocab)
    return origin, _wchoice(rng, _SEQ_BATCHES), build


def _sample_embedding(rng: random.Random, uniform: bool) -> _Recipe:
    if uniform:
        origin, n, dim, seq = "uniform", _logu(rng, 2, 200000), _logu(rng, 8, 1024), _logu(rng, 1, 1024)
    else:
        origin, n, dim, seqs = rng.choice(_EMBEDDINGS)
        seq = rng.choice(seqs)
    spec = {"op": "embedding", "num_embeddings": n, "embedding_dim": dim}

    def build(batch: int, shrink: int) -> LayerConfig | None:
        s = seq >> shrink
        if s < 1:
            return None
        return LayerConfig("embedding", "embedding", batch, (s,), spec, needs_input_grad=False)

    return origin, _wchoice(rng, _SEQ_BATCHES), build


def _recipe(rng: random.Random, family: str, uniform: bool) -> _Recipe:
    if family.startswith("conv"):
        return _sample_conv(rng, family, uniform)
    if family == "linear":
        return _sample_linear(rng, uniform)
    if family == "matmul":
        return _sample_matmul(rng, uniform)
    if family == "attention":
        return _sample_attention(rng, uniform)
    if family in ("lstm", "gru"):
        return _sample_rnn(rng, family, uniform)
    if family in ("batchnorm", "layernorm", "groupnorm", "instancenorm"):
        return _sample_norm(rng, family, uniform)
    if family in ("maxpool", "avgpool", "global_pool"):
        return _sample_pool(rng, family, uniform)
    if family in ("activation", "dropout"):
        return _sample_activation(rng, family, uniform)
    if family == "softmax":
        return _sample_softmax(rng, uniform)
    if family == "embedding":
        return _sample_embedding(rng, uniform)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILY_WEIGHTS)}")


def _valid(config: LayerConfig) -> bool:
    try:
        config.to_layers()
    except Exception:  # any invalid shape/spec means: draw again
        return False
    return True


def fit_to_budget(config: LayerConfig, build: _Build | None = None, *,
                  max_train_ms: float = DEFAULT_MAX_TRAIN_MS) -> LayerConfig | None:
    """Shrink ``config`` until :func:`estimate_train_ms` ≤ ``max_train_ms``: halve the batch down to 1,
    then (with ``build``) halve the spatial size / sequence length up to 4 times. ``None`` if impossible
    or invalid."""
    cur: LayerConfig | None = config
    shrink = 0
    while cur is not None:
        if not _valid(cur):
            return None
        if estimate_train_ms(cur) <= max_train_ms:
            return cur
        if cur.batch_size > 1:
            half = cur.batch_size // 2
            nxt = build(half, shrink) if build else replace(cur, batch_size=half)
            cur = replace(nxt, optimizer=cur.optimizer, origin=cur.origin) if nxt else None
            continue
        shrink += 1
        if build is None or shrink > 4:
            return None
        nxt = build(1, shrink)
        cur = replace(nxt, optimizer=cur.optimizer, origin=cur.origin) if nxt else None
    return None


def _with_optimizer(rng: random.Random, config: LayerConfig) -> LayerConfig:
    has_params = config.spec is not None and _valid(config) and config.params() > 0
    opt = _wchoice(rng, list(OPTIMIZER_WEIGHTS.items())) if has_params else "none"
    return replace(config, optimizer=opt)


def sample_configs(
    n: int, *, seed: int = 0, families: Iterable[str] | None = None, uniform_fraction: float = 0.1,
    max_train_ms: float = DEFAULT_MAX_TRAIN_MS,
) -> list[LayerConfig]:
    """Draw ``n`` distinct layer configurations (see module docstring).

    ``families`` restricts the draw to those keys of :data:`FAMILY_WEIGHTS` (relative weights kept).
    Deterministic for ``seed``; the first ``k`` configs of ``sample_configs(n)`` equal
    ``sample_configs(k)`` for ``k ≤ n`` with the same other arguments. Raises ``ValueError`` for an
    unknown family; may return fewer than ``n`` when the families have fewer distinct shapes.
    """
    fams = list(families) if families is not None else list(FAMILY_WEIGHTS)
    for f in fams:
        if f not in FAMILY_WEIGHTS:
            raise ValueError(f"unknown family {f!r}; known: {', '.join(FAMILY_WEIGHTS)}")
    weights = [FAMILY_WEIGHTS[f] for f in fams]
    rng = random.Random(seed)
    out: list[LayerConfig] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 50 * n + 100:
        attempts += 1
        family = rng.choices(fams, weights=weights)[0]
        uniform = rng.random() < uniform_fraction
        origin, batch, build = _recipe(rng, family, uniform)
        first = build(batch, 0)
        if first is None:
            continue
        first = _with_optimizer(rng, replace(first, origin=origin))
        cfg = fit_to_budget(first, build, max_train_ms=max_train_ms)
        if cfg is None or cfg.config_id in seen:
            continue
        seen.add(cfg.config_id)
        out.append(cfg)
    return out


# --------------------------------------------------------------------------------------------------
# Refinement: neighbours of the configurations the predictor gets most wrong
# --------------------------------------------------------------------------------------------------


def _scale(v: int, f: float, multiple: int = 1) -> int:
    x = max(1, round(v * f))
    if multiple > 1 and x >= multiple:
        x = round(x / multiple) * multiple
    return x


_CHANNEL_FIRST_OPS = frozenset({"conv1d", "conv2d", "conv", "maxpool", "avgpool", "global_avgpool",
                                "global_maxpool", "batchnorm", "groupnorm", "instancenorm"})


def perturb(config: LayerConfig, rng: random.Random) -> LayerConfig | None:
    """One random neighbour of ``config``: batch, a width (channels/features/hidden/heads) or a length
    (spatial side/sequence) scaled by 0.5, 0.75, 1.5 or 2. ``None`` if the result is invalid."""
    f = rng.choice((0.5, 0.75, 1.5, 2.0))
    knob = rng.choice(("batch", "width", "length"))
    if knob == "batch" or (config.spec is None and config.shapes is None):
        return replace(config, batch_size=_scale(config.batch_size, f), origin=f"refine:{config.config_id}")
    if config.shapes is not None:
        s = dict(config.shapes)
        if config.op == "matmul":
            a, b = list(s["a"]), list(s["b"])
            if knob == "width":
                a[-1] = b[-2] = _scale(a[-1], f)
            else:
                a[-2], b[-1] = _scale(a[-2], f), _scale(b[-1], f)
            s.update(a=a, b=b)
        elif knob == "width":
            s["head_dim"] = _scale(s["head_dim"], f, 8)
        else:
            s["seq_q"], s["seq_kv"] = _scale(s["seq_q"], f), _scale(s["seq_kv"], f)
        return replace(config, shapes=s, origin=f"refine:{config.config_id}")
    spec, shape = dict(config.spec or {}), list(config.input_shape)
    if knob == "length" and (len(shape) >= 3 or (len(shape) == 2 and config.op in _CHANNEL_FIRST_OPS)):
        shape[1:] = [_scale(x, f) for x in shape[1:]]  # (C, *spatial) or (heads, seq, seq)
    elif knob == "length" and (len(shape) == 2 or config.op == "embedding"):  # (seq, features) / (seq,)
        shape[0] = _scale(shape[0], f)
    elif knob == "length":
        return replace(config, batch_size=_scale(config.batch_size, f), origin=f"refine:{config.config_id}")
    else:
        for key in ("out_channels", "out_features", "hidden_size", "embedding_dim"):
            if key in spec:
                g = int(spec.get("groups", 1))
                if g > 1 and g == shape[0] == spec[key]:  # depthwise stays depthwise
                    spec[key] = spec["groups"] = shape[0] = _scale(g, f, 8)
                elif g > 1:  # grouped: scale the output width per group
                    spec[key] = _scale(spec[key] // g, f) * g
                else:
                    spec[key] = _scale(spec[key], f, 8)
                break
        else:
            shape[0] = _scale(shape[0], f, 8)
    return replace(config, spec=spec, input_shape=tuple(shape), origin=f"refine:{config.config_id}")


def propose_neighbours(
    errors: Iterable[tuple[LayerConfig, float]], *, n: int, seed: int = 0, top_fraction: float = 0.1,
    max_train_ms: float = DEFAULT_MAX_TRAIN_MS, exclude: Iterable[str] = (),
) -> list[LayerConfig]:
    """Neighbours of the worst-predicted configurations ("add points where the predictor is worst").

    ``errors`` pairs a configuration with its prediction error (any scale where larger is worse, e.g.
    ``|ln(predicted / measured)|``). The top ``top_fraction`` (at least one) by error are the parents;
    up to ``n`` distinct valid neighbours (:func:`perturb`, fitted to ``max_train_ms``) are drawn from
    them round-robin, worst first, skipping ids in ``exclude`` and the parents themselves.
    Deterministic for ``seed``.
    """
    ranked = sorted(errors, key=lambda ce: -abs(ce[1]))
    if not ranked or n <= 0:
        return []
    parents = [c for c, _ in ranked[: max(1, math.ceil(len(ranked) * top_fraction))]]
    seen = set(exclude) | {c.config_id for c in parents}
    rng = random.Random(seed)
    out: list[LayerConfig] = []
    for _ in range(20 * n):
        if len(out) >= n:
            break
        parent = parents[len(out) % len(parents)] if rng.random() < 0.7 else rng.choice(parents)
        cand = perturb(parent, rng)
        cand = fit_to_budget(cand, max_train_ms=max_train_ms) if cand is not None else None
        if cand is None or cand.config_id in seen:
            continue
        seen.add(cand.config_id)
        out.append(cand)
    return out


def family_for_spec(spec: Mapping[str, Any], input_shape: Sequence[int]) -> str:
    """The family (key of :data:`FAMILY_WEIGHTS`) of a JSON layer spec applied to a per-sample
    ``input_shape``. Raises ``ValueError`` for ops outside the families (``flatten``: a free view)."""
    op = str(spec["op"]).lower()
    if op == "conv1d":
        return "conv1d"
    if op in ("conv2d", "conv"):
        g = int(spec.get("groups", 1))
        return "conv2d" if g == 1 else ("conv2d_depthwise" if g == input_shape[0] else "conv2d_grouped")
    if op in ("linear", "dense"):
        return "linear"
    if op in ("global_avgpool", "global_maxpool"):
        return "global_pool"
    if op in _ACT_OPS or op == "swish":
        return "activation"
    if op in FAMILY_WEIGHTS:
        return op
    raise ValueError(f"op {op!r} belongs to no profiled family")


def family_counts(configs: Iterable[LayerConfig]) -> dict[str, int]:
    """Number of configurations per family (for progress and summaries)."""
    counts: dict[str, int] = {}
    for c in configs:
        counts[c.family] = counts.get(c.family, 0) + 1
    return counts
