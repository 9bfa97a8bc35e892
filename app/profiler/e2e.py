"""Whole training iterations of real architectures (``layercast profile e2e``), to validate the layer sum.

For every architecture in :data:`ARCHITECTURES` and each of its batch sizes, one JSON line records the
median time of a full training iteration — ``forward`` (model forward *including the loss*),
``backward`` (``loss.backward()``), ``update`` (``optimizer.step()``) and their per-repetition sum
``train_step`` — timed with :func:`app.profiler.timing.time_phases` after warm-up. Model weights and
inputs come from ``torch.manual_seed(seed)``, so every model is rebuilt deterministically from its
record: ``builder`` (a function of this module) + ``builder_config`` + ``seed``.

So that layercast can predict the same model, each record also carries how to get its graph:

* ``onnx``: the model (in ``eval()`` mode, returning logits) exported with ``torch.onnx.export``
  (TorchScript exporter, ``dynamo=False``, opset 17, no constant folding, symbolic batch axis), then
  imported with :func:`app.core.onnx_import.import_onnx` at the record's batch size — the record keeps
  the export arguments, the number of imported layers, unsupported ops, analytical FLOPs, size and
  SHA-256 of the bytes. The bytes themselves are not stored: :func:`export_onnx` rebuilds them.
* ``graph``: for the architectures built from a JSON layer list (VGG-11-BN/CIFAR, MobileNet V1, a
  2-layer LSTM language model), the document itself, which ``POST /v1/graphs`` accepts directly. For
  those, ``layer_sum`` is the sum over the layers of the same per-layer measurement the seed dataset
  uses (:func:`app.profiler.timing.measure_config`; the first layer without input gradient), so
  ``train_step_ms - layer_sum.train_step_ms`` is the per-iteration overhead (loss, framework glue,
  caching effects) that a layer-sum predictor must add.

Architectures (shapes reduced only where a single CPU core needs it): ResNet-50 (transformers,
96x96 input), MobileNetV2 (transformers, 128x128), ViT-S/16 with 6 layers (transformers, 128x128),
BERT with 4 layers/256 wide (transformers, sequence 128, classification head), GPT-2 with 4 layers/256
wide (transformers, full 50257 vocabulary, sequence 128, LM loss), and the three JSON models.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.profiler import iter_rows

E2E_SCHEMA = 1
ONNX_EXPORT_KWARGS: dict[str, Any] = {"dynamo": False, "opset_version": 17, "do_constant_folding": False}


def vgg11_bn_cifar_doc() -> dict[str, Any]:
    """VGG-11 with batch norm for 32x32 CIFAR-10 images (Simonyan & Zisserman 2015, CIFAR variant)."""
    layers: list[dict[str, Any]] = []
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append({"op": "maxpool", "kernel_size": 2, "stride": 2})
        else:
            layers += [{"op": "conv2d", "out_channels": v, "kernel_size": 3, "padding": 1, "bias": False},
                       {"op": "batchnorm"}, {"op": "relu"}]
    layers += [{"op": "flatten"}, {"op": "linear", "out_features": 10}]
    return {"name": "vgg11_bn_cifar", "input_shape": [3, 32, 32], "layers": layers}


def mobilenet_v1_doc(image_size: int = 128) -> dict[str, Any]:
    """MobileNet V1 1.0 (Howard et al. 2017): depthwise-separable blocks, purely sequential."""
    layers: list[dict[str, Any]] = [
        {"op": "conv2d", "out_channels": 32, "kernel_size": 3, "stride": 2, "padding": 1, "bias": False},
        {"op": "batchnorm"}, {"op": "relu"}]
    c = 32
    for c_out, s in ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1), (512, 1), (512, 1),
                     (512, 1), (512, 1), (1024, 2), (1024, 1)):
        layers += [{"op": "conv2d", "out_channels": c, "kernel_size": 3, "stride": s, "padding": 1, "groups": c,
                    "bias": False}, {"op": "batchnorm"}, {"op": "relu"},
                   {"op": "conv2d", "out_channels": c_out, "kernel_size": 1, "bias": False},
                   {"op": "batchnorm"}, {"op": "relu"}]
        c = c_out
    layers += [{"op": "global_avgpool"}, {"op": "flatten"}, {"op": "linear", "out_features": 1000}]
    return {"name": "mobilenet_v1", "input_shape": [3, image_size, image_size], "layers": layers}


def lstm_lm_doc(vocab: int = 10000, dim: int = 650, seq_len: int = 35) -> dict[str, Any]:
    """Two-layer LSTM language model, PTB "medium" (Zaremba et al. 2014): embedding → dropout → LSTM →
    dropout → LSTM → dropout → vocabulary projection."""
    return {"name": "lstm_lm_ptb_medium", "input_shape": [seq_len], "input_dtype": "int64", "layers": [
        {"op": "embedding", "num_embeddings": vocab, "embedding_dim": dim}, {"op": "dropout"},
        {"op": "lstm", "hidden_size": dim}, {"op": "dropout"}, {"op": "lstm", "hidden_size": dim},
        {"op": "dropout"}, {"op": "linear", "out_features": vocab}]}


@dataclass
class Built:
    """A model ready to train: ``loss(batch)`` runs forward + loss on a prepared batch."""

    module: Any
    make_batch: Callable[[int], dict[str, Any]]
    loss: Callable[[dict[str, Any]], Any]
    export_module: Any
    export_inputs: Callable[[dict[str, Any]], tuple[Any, ...]]
    input_names: list[str]
    import_dims: dict[str, int] = field(default_factory=dict)
    graph: dict[str, Any] | None = None


def _logits_module(model: Any, key: str) -> Any:
    """Wrap a transformers model so that ``forward(x)`` returns its logits (for ONNX export)."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(**{key: x}).logits

    return Logits()


def _images(image_size: int, classes: int) -> Callable[[int], dict[str, Any]]:
    import torch

    def make(batch: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(batch)
        return {"pixel_values": torch.randn(batch, 3, image_size, image_size, generator=g),
                "labels": torch.randint(0, classes, (batch,), generator=g)}
    return make


def _tokens(vocab: int, seq_len: int, labels: int | None) -> Callable[[int], dict[str, Any]]:
    import torch

    def make(batch: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
        return {"input_ids": ids, "labels": ids if labels is None else torch.randint(0, labels, (batch,), generator=g)}
    return make


def _hf(model: Any, key: str, make: Callable[[int], dict[str, Any]]) -> Built:
    return Built(model, make, lambda b: model(**b).loss, _logits_module(model, key), lambda b: (b[key],), [key])


def build_resnet(cfg: dict[str, Any]) -> Built:
    """transformers ``ResNetForImageClassification`` (``ResNetConfig`` keys + ``image_size``)."""
    import transformers as tf

    c = dict(cfg)
    size = c.pop("image_size")
    model = tf.ResNetForImageClassification(tf.ResNetConfig(**c))
    return _hf(model, "pixel_values", _images(size, c.get("num_labels", 1000)))


def build_mobilenet_v2(cfg: dict[str, Any]) -> Built:
    """transformers ``MobileNetV2ForImageClassification`` (``MobileNetV2Config`` keys)."""
    import transformers as tf

    model = tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(**cfg))
    return _hf(model, "pixel_values", _images(cfg["image_size"], cfg.get("num_labels", 1000)))


def build_vit(cfg: dict[str, Any]) -> Built:
    """transformers ``ViTForImageClassification`` (``ViTConfig`` keys)."""
    import transformers as tf

    model = tf.ViTForImageClassification(tf.ViTConfig(**cfg))
    return _hf(model, "pixel_values", _images(cfg["image_size"], cfg.get("num_labels", 1000)))


def build_bert(cfg: dict[str, Any]) -> Built:
    """transformers ``BertForSequenceClassification`` (``BertConfig`` keys + ``seq_len``)."""
    import transformers as tf

    c = dict(cfg)
    seq = c.pop("seq_len")
    model = tf.BertForSequenceClassification(tf.BertConfig(**c))
    return _hf(model, "input_ids", _tokens(model.config.vocab_size, seq, c.get("num_labels", 2)))


def build_gpt2(cfg: dict[str, Any]) -> Built:
    """transformers ``GPT2LMHeadModel`` (``GPT2Config`` keys + ``seq_len``), causal-LM loss."""
    import transformers as tf

    c = dict(cfg)
    seq = c.pop("seq_len")
    model = tf.GPT2LMHeadModel(tf.GPT2Config(**c))
    return _hf(model, "input_ids", _tokens(model.config.vocab_size, seq, None))


def build_json(cfg: dict[str, Any]) -> Built:
    """A JSON layer-list model (``cfg["doc"]``) as ``torch.nn.Sequential``, cross-entropy loss over the
    last axis of its output with random integer targets."""
    import torch
    import torch.nn.functional as F

    from app.profiler.timing import sequential_for_doc

    doc = cfg["doc"]
    seq = sequential_for_doc(doc)
    shape = list(doc["input_shape"])
    tokens = doc.get("input_dtype") == "int64"
    vocab = doc["layers"][0].get("num_embeddings", 0) if tokens else 0
    classes = doc["layers"][-1]["out_features"]

    def make(batch: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(batch)
        if tokens:
            return {"x": torch.randint(0, vocab, (batch, *shape), generator=g),
                    "y": torch.randint(0, classes, (batch, *shape), generator=g)}
        return {"x": torch.randn(batch, *shape, generator=g), "y": torch.randint(0, classes, (batch,), generator=g)}

    def loss(b: dict[str, Any]) -> Any:
        out = seq(b["x"])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), b["y"].reshape(-1))

    return Built(seq, make, loss, seq, lambda b: (b["x"],), ["x"], graph=doc)


@dataclass(frozen=True)
class Architecture:
    """One architecture of the e2e set: builder function name, its config, batch sizes, optimizer."""

    name: str
    builder: str
    config: dict[str, Any]
    batches: tuple[int, ...]
    optimizer: str
    source: str
    layer_sum: bool = False


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("resnet50", "build_resnet",
                 {"depths": [3, 4, 6, 3], "hidden_sizes": [256, 512, 1024, 2048], "layer_type": "bottleneck",
                  "embedding_size": 64, "num_labels": 1000, "image_size": 96}, (2, 4, 8), "momentum",
                 "transformers ResNetForImageClassification (ResNet-50 layout)"),
    Architecture("mobilenet_v2", "build_mobilenet_v2", {"image_size": 128, "num_labels": 1000}, (2, 8, 16),
                 "momentum", "transformers MobileNetV2ForImageClassification (1.0)"),
    Architecture("vit_s16_6l", "build_vit",
                 {"image_size": 128, "patch_size": 16, "hidden_size": 384, "num_hidden_layers": 6,
                  "num_attention_heads": 6, "intermediate_size": 1536, "num_labels": 1000}, (1, 4, 8), "adam",
                 "transformers ViTForImageClassification (ViT-S/16 width, 6 layers)"),
    Architecture("bert_4l_256", "build_bert",
                 {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
                  "num_labels": 2, "seq_len": 128}, (2, 8, 16), "adam",
                 "transformers BertForSequenceClassification (BERT-mini shape)"),
    Architecture("gpt2_4l_256", "build_gpt2", {"n_layer": 4, "n_embd": 256, "n_head": 4, "seq_len": 128},
                 (1, 2, 4), "adam", "transformers GPT2LMHeadModel (4 layers, 256 wide, 50257 vocab)"),
    Architecture("lstm_lm_ptb_medium", "build_json", {"doc": lstm_lm_doc()}, (4, 8, 20), "sgd",
                 "JSON layer list (torch.nn LSTM LM)", layer_sum=True),
    Architecture("vgg11_bn_cifar", "build_json", {"doc": vgg11_bn_cifar_doc()}, (8, 32, 64), "momentum",
                 "JSON layer list (torch.nn VGG-11-BN, CIFAR)", layer_sum=True),
    Architecture("mobilenet_v1_128", "build_json", {"doc": mobilenet_v1_doc(128)}, (2, 8, 16), "momentum",
                 "JSON layer list (torch.nn MobileNet V1 1.0, 128x128)", layer_sum=True),
)
_BY_NAME = {a.name: a for a in ARCHITECTURES}


def build(arch: Architecture | str, *, seed: int = 0) -> Built:
    """Build ``arch`` deterministically (``torch.manual_seed(seed)`` first). Raises ``ImportError``
    when its builder needs ``transformers`` and it is not installed."""
    import torch

    a = _BY_NAME[arch] if isinstance(arch, str) else arch
    torch.manual_seed(seed)
    return globals()[a.builder](a.config)


def export_onnx(arch: Architecture | str, *, batch_size: int = 2, seed: int = 0) -> bytes:
    """ONNX bytes of ``arch`` (eval mode, logits output, symbolic batch axis; see module docstring)."""
    import torch

    b = build(arch, seed=seed)
    b.export_module.eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(b.export_module, b.export_inputs(b.make_batch(batch_size)), buf,  # type: ignore[arg-type]
                          input_names=b.input_names, dynamic_axes={n: {0: "batch"} for n in b.input_names},
                          **ONNX_EXPORT_KWARGS)
    return buf.getvalue()


def _onnx_record(arch: Architecture, batch: int, seed: int, dims: dict[str, int]) -> dict[str, Any]:
    from app.core.analysis import analyze
    from app.core.onnx_import import import_onnx

    t0 = time.perf_counter()
    try:
        content = export_onnx(arch, batch_size=min(batch, 2), seed=seed)
        a = analyze(import_onnx(content, batch_size=batch, dims=dims))
    except Exception as exc:  # recorded: the timing is still valid without the graph
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {
        "status": "ok", "rebuild": f"app.profiler.e2e.export_onnx({arch.name!r}, seed={seed})",
        "export_kwargs": ONNX_EXPORT_KWARGS, "import_dims": dims, "bytes": len(content),
        "sha256": hashlib.sha256(content).hexdigest(), "layers": len(a.graph.layers),
        "unsupported": {u.op_type: u.count for u in a.unsupported}, "params": a.params,
        "forward_flops": a.forward_flops, "backward_flops": a.backward_flops,
        "export_s": round(time.perf_counter() - t0, 2),
    }


def _layer_sum(doc: dict[str, Any], batch: int, optimizer: str, budget_s: float) -> dict[str, Any]:
    """Per-layer measurement of a JSON model (same engine as the seed dataset) and its sum."""
    from dataclasses import replace

    from app.profiler.sampler import LayerConfig, family_for_spec
    from app.profiler.timing import measure_config, shape_after

    shape = tuple(doc["input_shape"])
    per_layer, fwd, train = [], 0.0, 0.0
    for i, spec in enumerate(doc["layers"]):
        nxt = shape_after(spec, shape)
        if spec["op"] == "flatten":  # a view: no kernel
            per_layer.append({"op": "flatten", "forward_ms": 0.0, "train_step_ms": 0.0})
            shape = nxt
            continue
        cfg = LayerConfig(family_for_spec(spec, shape), spec["op"], batch, shape, spec,
                          needs_input_grad=i > 0)
        cfg = replace(cfg, optimizer=optimizer if cfg.params() else "none")
        st = measure_config(cfg, budget_s=budget_s, warmup=2, reps=7)
        f, t = st["forward"].median_ms, st["train_step"].median_ms
        per_layer.append({"op": spec["op"], "config_id": cfg.config_id, "input_shape": list(shape),
                          "forward_ms": round(f, 5), "train_step_ms": round(t, 5)})
        fwd += f
        train += t
        shape = nxt
    return {"forward_ms": round(fwd, 4), "train_step_ms": round(train, 4), "layers": per_layer}


def measure_arch(arch: Architecture, batch: int, *, seed: int = 0, warmup: int = 2, reps: int = 5,
                 budget_s: float = 40.0, device: str = "cpu") -> dict[str, Any]:
    """Time full training iterations of ``arch`` at ``batch`` (see module docstring). Returns
    ``{"params": int, "timings": {phase: Stats dict}, "train_step_ms": float}``."""
    import torch

    from app.profiler.timing import make_clock, make_optimizer, time_phases

    b = build(arch, seed=seed)
    model = b.module.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(arch.optimizer, params)
    data = {k: v.to(device) for k, v in b.make_batch(batch).items()}
    state: dict[str, Any] = {}

    def zero() -> None:
        state.clear()
        opt.zero_grad(set_to_none=True)

    def fwd() -> None:
        state["loss"] = b.loss(data)

    phases = [("forward", fwd), ("backward", lambda: state["loss"].backward()), ("update", opt.step)]
    with torch.enable_grad():
        st = time_phases(phases, clock=make_clock(device), warmup=warmup, reps=reps, min_reps=3,
                         budget_s=budget_s, before_rep=zero, total_name="train_step")
    return {"params": sum(p.numel() for p in params), "timings": {k: v.to_dict() for k, v in st.items()},
            "train_step_ms": st["train_step"].to_dict()["median_ms"]}


def main(argv: Sequence[str] | None = None) -> int:
    """``layercast profile e2e``: measure :data:`ARCHITECTURES` into ``--out`` (JSONL, resumable by
    ``(arch, batch_size, precision)``). Returns 0, or 130 when interrupted."""
    p = argparse.ArgumentParser(prog="layercast profile e2e", description="whole training iterations")
    p.add_argument("--out", type=Path, default=Path("data/seed/e2e_cpu.jsonl"))
    p.add_argument("--archs", default="all", help=f"comma-separated subset of {','.join(_BY_NAME)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=40.0, help="budget per (architecture, batch)")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX export/import record")
    p.add_argument("--no-layer-sum", action="store_true", help="skip per-layer sums of the JSON models")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    import torch

    from app.profiler.run import _open_for_append
    from app.profiler.timing import device_context, record_machine

    torch.set_num_threads(args.threads)
    ctx = device_context(args.device)
    record_machine(args.out.parent, ctx)
    names = list(_BY_NAME) if args.archs == "all" else [n.strip() for n in args.archs.split(",")]
    archs = [_BY_NAME[n] for n in names]
    done = {(r["arch"], r["batch_size"], r.get("precision", "fp32")) for r in iter_rows(args.out)} \
        if args.out.exists() else set()
    fh = _open_for_append(args.out)
    try:
        for arch in archs:
            for batch in arch.batches:
                if (arch.name, batch, "fp32") in done:
                    continue
                t0 = time.perf_counter()
                row: dict[str, Any] = {
                    "schema": E2E_SCHEMA, "arch": arch.name, "source": arch.source,
                    "builder": f"app.profiler.e2e:{arch.builder}", "builder_config": arch.config,
                    "seed": args.seed, "batch_size": batch, "precision": "fp32", "optimizer": arch.optimizer,
                    "graph": arch.config.get("doc"),
                }
                try:
                    row.update(status="ok", error=None, **measure_arch(
                        arch, batch, seed=args.seed, warmup=args.warmup, reps=args.reps,
                        budget_s=args.max_seconds, device=args.device))
                except ImportError as exc:
                    row.update(status="error", error=f"missing dependency: {exc}")
                except Exception as exc:
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
                if row["status"] == "ok" and not args.no_onnx:
                    dims = build(arch, seed=args.seed).import_dims
                    row["onnx"] = _onnx_record(arch, batch, args.seed, dims)
                if row["status"] == "ok" and arch.layer_sum and not args.no_layer_sum:
                    row["layer_sum"] = _layer_sum(arch.config["doc"], batch, arch.optimizer, 1.5)
                row.update(measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
                           load_avg_1m=round(os.getloadavg()[0], 2), wall_s=round(time.perf_counter() - t0, 2),
                           context=ctx)
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")
                fh.flush()
                ls = row.get("layer_sum", {}).get("train_step_ms")
                print(f"{arch.name:<22} b={batch:<3} {row['status']:<5} train_step "
                      f"{row.get('train_step_ms', float('nan')):9.2f} ms"
                      + (f"  layer sum {ls:9.2f} ms" if ls is not None else "")
                      + (f"  onnx layers {row['onnx'].get('layers')}" if "onnx" in row else ""),
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted; rerun to resume", file=sys.stderr)
        return 130
    finally:
        fh.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
