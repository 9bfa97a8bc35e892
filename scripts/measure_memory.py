"""Measure real CPU training memory with torch and compare it with layercast's analytical footprint.

Usage: ``python scripts/measure_memory.py [--out docs/memory_validation.md] [--only NAME]`` (needs the
``train`` extra and transformers; a few minutes on 2 cores).

Ten architectures (CNNs built by hand, because torchvision is not a dependency: ResNet-18, ResNet-50,
VGG-11, MobileNetV2, a small AlexNet-style net with max-pool and dropout, an MLP with dropout;
transformers from ``transformers`` configs at small sizes: BERT, GPT-2, ViT; and a 2-layer LSTM language
model), each in training mode at three batch sizes, in fp32 and under ``torch.autocast("cpu",
dtype=torch.bfloat16)``. Small widths and images keep it fast: the estimate/measured ratio is what
matters.

Measurement of one Adam training step (forward, ``loss.backward()``, ``optimizer.step()``), after a
warm-up step that creates the optimizer state and ``zero_grad(set_to_none=True)``:

* **saved activations**: every tensor autograd saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``, counted once per storage (``untyped_storage()``: a view
  and its base are one allocation), parameters excluded (they are the weights); the model output, alive
  at the end of the forward pass, is added;
* **loss**: cross-entropy of the (float) logits against random targets, computed outside autocast, as
  classifiers and language models train;
* **peak**: the live bytes of all tensor storages, sampled after every aten op of the step by a
  ``TorchDispatchMode`` that tracks each op's output storages with weak references (an allocation is
  live until its storage is freed), plus the parameters, optimizer state, inputs and autocast's cached
  weight copies that exist before the step. This is the curve torch's CPU allocator serves; scratch
  buffers a kernel frees before it returns (oneDNN) are not seen, the Python heap is not tensor memory.

The estimate is ``footprint(analyze(import_onnx(...)), mode="training", optimizer="adam",
precision=...)`` on a training-mode legacy ONNX export of the same module (``dynamo=False``,
``TrainingMode.TRAINING``; one export per architecture with a symbolic batch, imported at each batch),
for a CPU device (no CUDA context, no allocator rounding, no cuDNN/cuBLAS workspace).
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.core.analysis import analyze  # noqa: E402
from app.core.hardware import HardwareSpec  # noqa: E402
from app.core.memory import MemoryFootprint, footprint  # noqa: E402
from app.core.onnx_import import import_onnx  # noqa: E402

CPU = HardwareSpec(id="cpu", name="CPU", vendor="any", kind="cpu", peak_flops_per_s={"fp32": 1e11},
                   memory_bytes=2**36, memory_bandwidth_bytes_per_s=1e10, compute_units=2)
LOW, HIGH = 0.85, 1.25  # acceptance band of estimate / measured (issue 7, item 5)


# ---------------------------------------------------------------- models (hand-built CNNs, HF transformers)
def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(_conv_bn(cin, width, 3, stride), _conv_bn(width, cout, 3, act=False))
        self.short = (_conv_bn(cin, cout, 1, stride, act=False) if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.short(x))


class _Bottleneck(_Basic):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        nn.Module.__init__(self)
        cout = width * 4
        self.body = nn.Sequential(_conv_bn(cin, width, 1), _conv_bn(width, width, 3, stride),
                                  _conv_bn(width, cout, 1, act=False))
        self.short = (_conv_bn(cin, cout, 1, stride, act=False) if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)


def resnet(block: type[_Basic], depths: tuple[int, ...], classes: int = 100) -> nn.Module:
    """torchvision-equivalent ResNet (He et al. 2016): 7x7 stem, max-pool, 4 stages, avg-pool, fc."""
    layers: list[nn.Module] = [_conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for i, n in enumerate(depths):
        for j in range(n):
            layers.append(block(cin, 64 * 2**i, 2 if j == 0 and i > 0 else 1))
            cin = 64 * 2**i * block.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def vgg11(classes: int = 100) -> nn.Module:
    """VGG-11 (configuration A, Simonyan & Zisserman 2015) with BatchNorm and a CIFAR-size classifier."""
    layers: list[nn.Module] = []
    cin = 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.BatchNorm2d(int(v)), nn.ReLU(inplace=True)]
            cin = int(v)
    layers += [nn.Flatten(), nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hid = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hid, 1, bias=False), nn.BatchNorm2d(hid), nn.ReLU6(inplace=True)]
        layers += [nn.Conv2d(hid, hid, 3, stride, 1, groups=hid, bias=False), nn.BatchNorm2d(hid),
                   nn.ReLU6(inplace=True), nn.Conv2d(hid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


def mobilenet_v2(classes: int = 100) -> nn.Module:
    """MobileNetV2 (Sandler et al. 2018), width 1.0, torchvision's layer list."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(inplace=True)]
    cin = 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            layers.append(_InvertedResidual(cin, c, s if i == 0 else 1, t))
            cin = c
    layers += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


def alexnet_small(classes: int = 100) -> nn.Module:
    """AlexNet-style net: conv+ReLU, overlapping max-pool (indices saved), dropout in the classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 5, 2, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Flatten(), nn.Dropout(0.5), nn.Linear(256 * 3 * 3, 1024), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(1024, classes))


def mlp(classes: int = 10) -> nn.Module:
    """MLP 1024-2048-2048-classes with GELU and dropout."""
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 2048), nn.GELU(),
                         nn.Dropout(0.1), nn.Linear(2048, classes))


class LstmLM(nn.Module):
    """Embedding → 2-layer LSTM (batch-first) → vocabulary projection."""

    def __init__(self, vocab: int = 5000, emb: int = 256, hidden: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


class _HF(nn.Module):
    """Wraps a transformers model so that it takes one tensor and returns its first output."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.m, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(**{self.key: x}, return_dict=False)[0]


def _bert() -> nn.Module:
    import transformers as tf
    cfg = tf.BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return _HF(tf.BertForMaskedLM(cfg), "input_ids")


def _gpt2() -> nn.Module:
    import transformers as tf
    cfg = tf.GPT2Config(vocab_size=8000, n_embd=256, n_layer=4, n_head=4, n_positions=256, attn_pdrop=0.0,
                        attn_implementation="sdpa")
    return _HF(tf.GPT2LMHeadModel(cfg), "input_ids")


def _vit() -> nn.Module:
    import transformers as tf
    cfg = tf.ViTConfig(image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       intermediate_size=1024, hidden_dropout_prob=0.1, attn_implementation="sdpa")
    return _HF(tf.ViTForImageClassification(cfg), "pixel_values")


@dataclass(frozen=True)
class Case:
    """One architecture: builder, example input at batch ``b``, three batch sizes, extra ONNX dims."""

    name: str
    build: Callable[[], nn.Module]
    example: Callable[[int], torch.Tensor]
    batches: tuple[int, int, int]
    dims: dict[str, int]


def _img(size: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randn(b, 3, size, size)


def _tokens(seq: int, vocab: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randint(0, vocab, (b, seq))


CASES: tuple[Case, ...] = (
    Case("ResNet-18 (64x64)", lambda: resnet(_Basic, (2, 2, 2, 2)), _img(64), (4, 16, 48), {}),
    Case("ResNet-50 (64x64)", lambda: resnet(_Bottleneck, (3, 4, 6, 3)), _img(64), (4, 12, 32), {}),
    Case("VGG-11-BN (32x32)", vgg11, _img(32), (8, 32, 96), {}),
    Case("MobileNetV2 (64x64)", mobilenet_v2, _img(64), (4, 16, 48), {}),
    Case("AlexNet-small (64x64)", alexnet_small, _img(64), (8, 32, 128), {}),
    Case("MLP+dropout", mlp, lambda b: torch.randn(b, 1024), (32, 256, 1024), {}),
    Case("BERT-mini MLM (4x256, seq 128)", _bert, _tokens(128, 8000), (2, 8, 24), {"seq": 128}),
    Case("GPT-2-mini LM (4x256, seq 128)", _gpt2, _tokens(128, 8000), (2, 8, 24), {"seq": 128}),
    Case("ViT-mini (4x256, 64x64/8)", _vit, _img(64), (4, 16, 48), {}),
    Case("LSTM LM (2x512, seq 64)", LstmLM, _tokens(64, 5000), (4, 16, 48), {"seq": 64}),
)


# ---------------------------------------------------------------- measurement
def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class LiveBytes(TorchDispatchMode):
    """Tracks the storages every aten op returns; ``peak`` is the largest live total seen after an op."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[tuple[int, int], StorageWeakRef] = {}
        for t in existing:
            self._track(t)
        self.peak = self.now()

    def _track(self, t: object) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse:
            key = _storage_key(t)
            if key[1] and (key not in self.live or self.live[key].expired()):
                self.live[key] = StorageWeakRef(t.untyped_storage())

    def now(self) -> int:
        dead = [k for k, ref in self.live.items() if ref.expired()]
        for k in dead:
            del self.live[k]
        return sum(k[1] for k in self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            self._track(t)
        self.peak = max(self.peak, self.now())
        return out


def measure(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, *, bf16: bool) -> dict[str, int]:
    """One measured Adam step of ``model`` on ``x`` with a cross-entropy loss on random targets: saved
    activation bytes (the loss's included) and the live-bytes peak."""
    with torch.no_grad():
        classes = model(x[:1]).shape[-1]
    target = torch.randint(0, classes, (x.shape[0], *((x.shape[1],) if x.dim() == 2 and x.dtype == torch.int64
                                                         else ())))
    params = list(model.parameters())
    pkeys = {_storage_key(p) for p in params}
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in pkeys and key[1]:
            saved[key] = key[1]
        return t

    opt.zero_grad(set_to_none=True)
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    mode = LiveBytes([*params, *state, x])
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
        at_fwd_end = sum(saved.values()) + (0 if _storage_key(out) in saved else _storage_key(out)[1])
        loss.backward()
        del out, loss
        opt.step()
    return {"weights": sum(p.nbytes for p in params), "optimizer_state": sum(t.nbytes for t in state),
            "activations": at_fwd_end, "peak": mode.peak}


def export(model: nn.Module, x: torch.Tensor, case: Case) -> bytes:
    """Training-mode legacy ONNX export with a symbolic batch (and sequence) axis."""
    buf = io.BytesIO()
    dyn = {0: "batch", 1: "seq"} if case.dims else {0: "batch"}
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), buf, input_names=["x"], dynamic_axes={"x": dyn}, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return buf.getvalue()


def estimate(onnx_bytes: bytes, batch: int, case: Case, *, bf16: bool) -> MemoryFootprint:
    """layercast's footprint of one Adam training step on a CPU device."""
    a = analyze(import_onnx(onnx_bytes, batch_size=batch, dims=case.dims))
    return footprint(a, mode="training", optimizer="adam", precision="bf16" if bf16 else "fp32", hardware=CPU)


@dataclass(frozen=True)
class Row:
    case: str
    batch: int
    precision: str
    est: MemoryFootprint
    meas: dict[str, int]

    @property
    def ratio(self) -> float:
        return self.est.total_bytes / self.meas["peak"]


def run(cases: tuple[Case, ...]) -> Iterator[Row]:
    """Estimate and measure every case at its three batch sizes, fp32 and bf16 autocast."""
    for case in cases:
        torch.manual_seed(0)
        model = case.build().train()
        onnx_bytes = export(model, case.example(case.batches[0]), case)
        opt = torch.optim.Adam(model.parameters())
        model(case.example(case.batches[0])).float().sum().backward()
        opt.step()  # creates Adam's state
        for bf16 in (False, True):
            for b in case.batches:
                x = case.example(b)
                yield Row(case.name, b, "bf16" if bf16 else "fp32", estimate(onnx_bytes, b, case, bf16=bf16),
                          measure(model, x, opt, bf16=bf16))


class _Checkpointed(nn.Module):
    """``checkpoint_sequential`` over ``segments`` pieces of a ``nn.Sequential`` (non-reentrant)."""

    def __init__(self, model: nn.Module, segments: int) -> None:
        super().__init__()
        self.m, self.segments = model, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.m, min(self.segments, len(self.m)), x, use_reentrant=False)


def run_checkpointed(names: tuple[str, ...] = ("ResNet-50", "VGG-11", "MobileNetV2")) -> Iterator[tuple[Row, int]]:
    """The Sequential CNNs at their largest batch under ``checkpoint_sequential`` with ⌈√L⌉ segments (L =
    layers of the import), against the estimate with ``activation_checkpointing=True``."""
    for case in (c for c in CASES if c.name.startswith(names)):
        torch.manual_seed(0)
        model = case.build().train()
        b = case.batches[-1]
        onnx_bytes = export(model, case.example(case.batches[0]), case)
        a = analyze(import_onnx(onnx_bytes, batch_size=b, dims=case.dims))
        segments = math.ceil(math.sqrt(len(a.graph.layers)))
        opt = torch.optim.Adam(model.parameters())
        model(case.example(2)).float().sum().backward()
        opt.step()
        for bf16 in (False, True):
            est = footprint(a, mode="training", optimizer="adam", precision="bf16" if bf16 else "fp32",
                            hardware=CPU, activation_checkpointing=True)
            meas = measure(_Checkpointed(model, segments), case.example(b), opt, bf16=bf16)
            yield Row(case.name, b, "bf16" if bf16 else "fp32", est, meas), segments


def table(rows: list[Row]) -> list[str]:
    """Markdown table: one row per (architecture, batch, precision)."""
    mib = 2**20
    lines = ["| model | batch | precision | saved activations est / meas (MiB) | peak est / meas (MiB) "
             "| peak est / meas |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        saved = r.est.activations_bytes + r.est.weight_copies_bytes
        lines.append(f"| {r.case} | {r.batch} | {r.precision} | {saved / mib:.1f} / "
                     f"{r.meas['activations'] / mib:.1f} | {r.est.total_bytes / mib:.1f} / "
                     f"{r.meas['peak'] / mib:.1f} | {r.ratio:.2f} |")
    return lines


def summary(rows: list[Row]) -> list[str]:
    """Markdown table: per architecture, the range of estimate / measured peak in fp32 and bf16."""
    lines = ["| model | batches | peak est / meas, fp32 | peak est / meas, bf16 autocast |", "|---|---|---:|---:|"]
    for name in dict.fromkeys(r.case for r in rows):
        rs = [r for r in rows if r.case == name]
        cells = []
        for prec in ("fp32", "bf16"):
            q = [r.ratio for r in rs if r.precision == prec]
            cells.append(f"{min(q):.2f}-{max(q):.2f}")
        batches = ", ".join(str(b) for b in dict.fromkeys(r.batch for r in rs))
        lines.append(f"| {name} | {batches} | {cells[0]} | {cells[1]} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "memory_validation.md"))
    ap.add_argument("--only", help="run only the architectures whose name contains this (no file written)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = tuple(c for c in CASES if args.only is None or args.only.lower() in c.name.lower())
    t0 = time.time()
    rows: list[Row] = []
    for r in run(cases):
        rows.append(r)
        mib = 2**20
        saved = r.est.activations_bytes + r.est.weight_copies_bytes
        print(f"{r.case:34s} b={r.batch:5d} {r.precision}  act {saved / mib:8.1f} / "
              f"{r.meas['activations'] / mib:8.1f}  peak {r.est.total_bytes / mib:8.1f} / "
              f"{r.meas['peak'] / mib:8.1f}  ratio {r.ratio:.3f}", flush=True)
    if args.only:
        return
    ratios = [r.ratio for r in rows]
    ok = all(LOW <= q <= HIGH for q in ratios)
    ck_lines = ["| model | batch | precision | segments | peak est / meas (MiB) | peak est / meas |",
                "|---|---:|---|---:|---:|---:|"]
    for r, seg in run_checkpointed():
        print(f"checkpointed {r.case:34s} b={r.batch} {r.precision} ratio {r.ratio:.3f}", flush=True)
        ck_lines.append(f"| {r.case} | {r.batch} | {r.precision} | {seg} | {r.est.total_bytes / 2**20:.1f} / "
                        f"{r.meas['peak'] / 2**20:.1f} | {r.ratio:.2f} |")
    doc = Path(args.out)
    head = doc.read_text().split("<!-- table -->")[0] if doc.exists() else ""
    lines = [head.rstrip(), "", "<!-- table -->",
             f"Generated by `python scripts/measure_memory.py` in {time.time() - t0:.0f} s (torch {torch.__version__},"
             f" CPU, 1 thread, Adam). Peak ratio range {min(ratios):.2f}-{max(ratios):.2f} over {len(rows)} "
             f"configurations ({'all' if ok else 'NOT all'} within {LOW}-{HIGH}).", "", *summary(rows), "",
             "Every configuration:", "", *table(rows), "",
             "Activation checkpointing (not in the acceptance band): `torch.utils.checkpoint.checkpoint_sequential`"
             " over the same number of segments as the estimate, ⌈√L⌉ for L imported layers. The estimate assumes"
             " segments balanced by saved bytes and every segment recomputed; `checkpoint_sequential` cuts by"
             " module count and runs its last segment without checkpointing, so it keeps more where the early"
             " layers dominate (MobileNetV2).", "", *ck_lines, ""]
    doc.write_text("\n".join(lines).lstrip())
    print("wrote", doc, "ratio range", min(ratios), max(ratios))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
