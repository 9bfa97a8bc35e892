"""Real architectures with random weights, exported to ONNX once per test session, with oracle figures.

Every model is built from its ``transformers`` config (no download) or from ``torch.nn`` modules,
its weights perturbed by 1e-3 Gaussian noise (the TorchScript exporter merges initializers with
identical values, so the all-zero biases and all-one LayerNorm gains of a fresh model would otherwise
collapse into one tensor; trained weights never coincide), and exported with
``torch.onnx.export(..., dynamo=False)``, the stable TorchScript exporter, with its default constant
folding, like a user would. Text models get a symbolic ``seq`` axis (bound with ``dims`` on import).

The oracle is ``torch.utils.flop_counter.FlopCounterMode`` run on the same module at the same shapes.
It counts 2 × MACs of matmul/addmm/bmm/convolution/attention kernels only, so it is compared with
:func:`app.core.analysis.mac_class_flops`. Attention runs with ``attn_implementation="eager"`` (explicit
``Q·Kᵀ`` and ``A·V`` bmm that the oracle counts; the CPU flash kernel behind SDPA is not registered in
FlopCounterMode and would count as zero).
"""

from __future__ import annotations

import fcntl
import functools
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

SEQ = 16
BATCH = 1
RNN_VOCAB, RNN_EMB, RNN_HIDDEN, RNN_LAYERS, RNN_SEQ, RNN_BATCH = 1000, 128, 256, 2, 12, 2


@dataclass(frozen=True)
class Exported:
    """An exported model and what torch says about it."""

    name: str
    onnx_bytes: bytes
    batch_size: int
    dims: dict[str, int]
    torch_params: int  # distinct parameters (tied weights once), from module.parameters()
    oracle_flops: int  # FlopCounterMode total, forward, same shapes
    oracle_by_op: dict[str, int]
    tied: bool = False  # GPT-2: lm_head.weight is transformer.wte.weight


def _perturb(module) -> None:  # noqa: ANN001 - torch module
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def _export(module, args, *, dynamic: dict, constant_folding: bool = True) -> bytes:  # noqa: ANN001
    import torch

    buf = io.BytesIO()
    torch.onnx.export(
        module, args, buf, input_names=["x"], dynamic_axes={"x": dynamic}, dynamo=False, opset_version=17,
        do_constant_folding=constant_folding,
    )
    return buf.getvalue()


def _oracle(module, args) -> tuple[int, dict[str, int]]:  # noqa: ANN001
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc, torch.no_grad():
        module(*args)
    return int(fc.get_total_flops()), {str(k): int(v) for k, v in fc.get_flop_counts()["Global"].items()}


def _wrap(model, key: str, *, both_outputs: bool = False):  # noqa: ANN001, ANN202
    """A module taking one positional tensor, returning plain tensors (the exporter needs no kwargs)."""
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x):  # noqa: ANN001, ANN202
            # an explicit all-ones mask keeps transformers off its packed-sequence detection (aten::diff,
            # which the exporter cannot convert)
            kw = {"attention_mask": torch.ones_like(x)} if key == "input_ids" else {}
            out = self.m(**{key: x}, **kw, return_dict=False)
            return (out[0], out[1]) if both_outputs else out[0]

    return Wrap().eval()


def hf_model(name: str):  # noqa: ANN201
    """The transformers model for ``name`` (bert, gpt2, vit, resnet50, mobilenet_v2), random weights."""
    import torch
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    eager = {"attn_implementation": "eager"}
    if name == "bert":
        return tf.BertModel(tf.BertConfig(**eager))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(use_cache=False, **eager))
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(**eager), add_pooling_layer=False)
    if name == "resnet50":
        return tf.ResNetForImageClassification(tf.ResNetConfig(num_labels=1000))
    if name == "mobilenet_v2":
        return tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(num_labels=1000))
    raise KeyError(name)


@functools.cache
def _prepared(name: str):  # noqa: ANN202 - (module, args, dynamic axes, dims, torch params, tied)
    """The perturbed, wrapped module of ``name`` with its example input, built once per session."""
    import torch

    if name in ("lstm_lm", "lstm_bi_lm", "gru_lm"):
        lm = rnn_lm(name)
        x = torch.randint(0, RNN_VOCAB, (RNN_BATCH, RNN_SEQ))
        return lm, (x,), {0: "batch", 1: "seq"}, {"seq": RNN_SEQ}, sum(p.numel() for p in lm.parameters()), False
    model = hf_model(name).eval()
    _perturb(model)
    text = name in ("bert", "gpt2")
    wrapped = _wrap(model, "input_ids" if text else "pixel_values", both_outputs=(name == "bert"))
    if text:
        args = (torch.randint(0, 1000, (BATCH, SEQ)),)
        dynamic, dims = {0: "batch", 1: "seq"}, {"seq": SEQ}
    else:
        args = (torch.randn(BATCH, 3, 224, 224),)
        dynamic, dims = {0: "batch"}, {}
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    tied = name == "gpt2" and model.lm_head.weight is model.transformer.wte.weight
    return wrapped, args, dynamic, dims, params, tied


#: Folder shared by every pytest-xdist worker of one run where :func:`exported` keeps what it built, so a
#: model is exported once per run, not once per worker (set by ``tests/conftest.py``; None: in this process only).
SHARED_DIR: Path | None = None


@functools.cache
def exported(name: str) -> Exported:
    """Build, perturb, measure with the oracle and export ``name`` (TorchScript exporter, with weights): once per
    process, and once per run where :data:`SHARED_DIR` is set (the first worker to ask builds it under a file
    lock and pickles it there; the others wait for it and read it)."""
    if SHARED_DIR is None:
        return _export_with_oracle(name)
    path = SHARED_DIR / f"{name}.pickle"
    with (SHARED_DIR / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if path.exists():
            found = pickle.loads(path.read_bytes())
            assert isinstance(found, Exported) and found.name == name, path
            return found
        built = _export_with_oracle(name)
        partial = path.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(built, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(partial, path)
        return built


def _export_with_oracle(name: str) -> Exported:
    module, args, dynamic, dims, params, tied = _prepared(name)
    if name.startswith("lstm"):
        flops, by_op = unrolled_lstm_oracle(module, args[0]), {}
    else:
        flops, by_op = _oracle(module, args)
    content = _export(module, args, dynamic=dynamic)
    return Exported(name, content, RNN_BATCH if name.endswith("_lm") else BATCH, dims, params, flops, by_op, tied)


def export_variant(name: str, *, dynamo: bool, weights: str) -> tuple[bytes, dict[str, int]]:
    """ONNX bytes of ``name`` as a user exports it today, and the ``dims`` that bind its symbolic axes.

    ``weights`` is ``"inline"`` (in the file), ``"none"`` (``export_params=False``) or, dynamo only,
    ``"external"`` (torch 2.13's default ``torch.onnx.export(model, args, "m.onnx")``: weights in
    ``m.onnx.data``; only the ``.onnx`` is returned, as a user uploads it).
    ``dynamo=False``: the TorchScript exporter (opset 17, ``dynamic_axes``).
    ``dynamo=True``: the default exporter (opset 18+, torch.export naming, dims named by ``torch.export``
    such as ``s27``), every axis ``Dim.AUTO``; without weights, ``keep_initializers_as_inputs=True`` (weights
    and constants listed as inputs without data). The sequence axis is bound to the length of :func:`exported`.
    """
    import tempfile

    import onnx
    import torch

    module, args, dynamic, dims, _, _ = _prepared(name)
    if not dynamo:
        buf = io.BytesIO()
        torch.onnx.export(module, args, buf, input_names=["x"], dynamic_axes={"x": dynamic}, dynamo=False,
                          opset_version=17, export_params=weights == "inline")
        return buf.getvalue(), dims
    auto = torch.export.Dim.AUTO
    kw = {"input_names": ["x"], "dynamic_shapes": {"x": {k: auto for k in dynamic}}, "dynamo": True, "verbose": False}
    if weights == "external":
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.onnx"
            torch.onnx.export(module, args, str(path), **kw)
            assert (Path(d) / "m.onnx.data").is_file()  # the weights went to the side file
            content = path.read_bytes()
    else:
        buf = io.BytesIO()
        torch.onnx.export(module, args, buf, external_data=False, export_params=weights == "inline",
                          keep_initializers_as_inputs=weights == "none", **kw)
        content = buf.getvalue()
    x = next(vi for vi in onnx.load_model_from_string(content).graph.input if vi.name == "x")
    axes = [d.dim_param for d in x.type.tensor_type.shape.dim]
    seq = dims.get("seq")
    return content, ({axes[1]: seq} if seq is not None and len(axes) > 1 and axes[1] else {})


def rnn_lm(name: str):  # noqa: ANN201
    """Embedding → 2-layer LSTM/GRU (bidirectional for ``lstm_bi_lm``) → Linear language model."""
    import torch

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cell = torch.nn.GRU if name.startswith("gru") else torch.nn.LSTM
            bi = name == "lstm_bi_lm"
            self.emb = torch.nn.Embedding(RNN_VOCAB, RNN_EMB)
            self.rnn = cell(RNN_EMB, RNN_HIDDEN, num_layers=RNN_LAYERS, batch_first=True, bidirectional=bi)
            self.head = torch.nn.Linear(RNN_HIDDEN * (2 if bi else 1), RNN_VOCAB)

        def forward(self, x):  # noqa: ANN001, ANN202
            h, _ = self.rnn(self.emb(x))
            return self.head(h)

    torch.manual_seed(0)
    return LM().eval()


def unrolled_lstm_oracle(lm, x) -> int:  # noqa: ANN001
    """FlopCounterMode FLOPs of ``lm`` with its fused LSTM replaced by the same weights in LSTMCell steps.

    ``torch.nn.LSTM`` runs as one fused kernel that FlopCounterMode does not count (it reports only the
    head). ``LSTMCell`` decomposes into counted matmuls, so unrolling every layer, direction and
    timestep with the LSTM's own weights gives an independent count; the unrolled output is checked
    against the fused one so the two are the same computation.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    rnn = lm.rnn
    dirs = 2 if rnn.bidirectional else 1
    cells = {}
    for layer in range(rnn.num_layers):
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            in_size = rnn.input_size if layer == 0 else rnn.hidden_size * dirs
            cell = torch.nn.LSTMCell(in_size, rnn.hidden_size)
            with torch.no_grad():
                cell.weight_ih.copy_(getattr(rnn, "weight_ih" + sfx))
                cell.weight_hh.copy_(getattr(rnn, "weight_hh" + sfx))
                cell.bias_ih.copy_(getattr(rnn, "bias_ih" + sfx))
                cell.bias_hh.copy_(getattr(rnn, "bias_hh" + sfx))
            cells[layer, d] = cell

    def forward(tokens):  # noqa: ANN001, ANN202
        h = lm.emb(tokens)
        b, t = tokens.shape
        for layer in range(rnn.num_layers):
            outs = []
            for d in range(dirs):
                hx = torch.zeros(b, rnn.hidden_size)
                cx = torch.zeros(b, rnn.hidden_size)
                steps = range(t - 1, -1, -1) if d else range(t)
                seq = [None] * t
                for s in steps:
                    hx, cx = cells[layer, d](h[:, s], (hx, cx))
                    seq[s] = hx
                outs.append(torch.stack(seq, 1))
            h = torch.cat(outs, -1)
        return lm.head(h)

    with torch.no_grad():
        torch.testing.assert_close(forward(x), lm(x), rtol=1e-4, atol=1e-5)
        with FlopCounterMode(display=False) as fc:
            forward(x)
    return int(fc.get_total_flops())
