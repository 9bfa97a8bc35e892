"""One short GPU measurement session (issue 8 item 8): ~3,000 kernels and 6 whole models in about 8 minutes.

Run on a CUDA machine (torch only; no torchvision, no transformers)::

    python -m app.profiler.gpu_bench --out-dir data/gpu/h200 --max-seconds 450
    layercast import profiler --data-dir data/gpu/h200 --hardware-id h200

It writes two shards in the profiler's row format (:mod:`app.profiler.run`, :mod:`app.profiler.e2e`), which
``layercast import profiler`` reads (:mod:`app.measurements.profiler_rows`; ``--hardware-id`` names the
catalog entry of the GPU measured):

* ``e2e_<tag>.jsonl`` first (so whole iterations exist even if the session is cut short): the training
  iterations of :data:`MODELS` — six ``torch.nn`` models built from JSON layer lists (VGG-11-BN/CIFAR,
  MobileNet V1, the PTB LSTM LM of :mod:`app.profiler.e2e`, and VGG-16-BN at 224, a 4-block 1024-wide MLP
  and a 1-D conv net defined here) — at two batch sizes each, timed as ``forward`` (with the loss),
  ``backward``, ``update`` and ``train_step`` with CUDA events (:func:`app.profiler.timing.time_phases`);
* ``layers_<tag>.jsonl``: ``--n-configs`` layer configurations drawn by
  :func:`app.profiler.sampler.sample_configs` from the GEMM (linear, matmul), convolution (dense and
  depthwise), attention (``scaled_dot_product_attention``), normalisation (batch, layer, group) and
  element-wise (activation, softmax) families, sized for a GPU (``--max-train-ms`` of the sampler's CPU
  estimate), each timed in every precision of ``--precisions`` by
  :func:`app.profiler.timing.measure_config` (inference forward, training forward, backward, optimizer
  update, CUDA events).

Precisions (``precision`` of each row, the semantics of :mod:`app.core.precision`): ``fp32`` is PyTorch's
default (``torch.backends.cuda.matmul.allow_tf32`` False, ``torch.backends.cudnn.allow_tf32`` True);
``tf32`` turns both on; ``bf16`` times layers on bfloat16 tensors (the kernels autocast runs for matmul and
convolution) and whole models under ``torch.autocast(dtype=torch.bfloat16)`` with fp32 weights. Each row's
``context`` holds the device name, compute capability, torch / CUDA / cuDNN versions, the TF32 flags, the
granularity (``layer`` or ``iteration``) and the bench's command line.

Time: ``--max-seconds`` bounds the whole session (whole models get at most a quarter of it, each
measurement ``--kernel-budget-s`` / ``--model-budget-s``); rows are flushed one by one and a rerun of the same
command skips what is already in the shards. ``--smoke`` is a seconds-long CPU run of the same code (a few
tiny configurations, two tiny models, fp32 and bf16) that the tests import through the real importer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.profiler import ROW_SCHEMA, iter_rows
from app.profiler.e2e import E2E_SCHEMA, Architecture, lstm_lm_doc, mobilenet_v1_doc, vgg11_bn_cifar_doc

KERNEL_FAMILIES: tuple[str, ...] = (
    "linear", "matmul", "conv2d", "conv2d_depthwise", "attention", "batchnorm", "layernorm", "groupnorm",
    "activation", "softmax",
)
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16")
#: Share of ``--max-seconds`` the whole models may use before the kernels start.
MODEL_SHARE = 0.25


def vgg16_bn_doc(image_size: int = 224) -> dict[str, Any]:
    """VGG-16 with batch norm at ImageNet size (Simonyan & Zisserman 2015, configuration D)."""
    layers: list[dict[str, Any]] = []
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append({"op": "maxpool", "kernel_size": 2, "stride": 2})
        else:
            layers += [{"op": "conv2d", "out_channels": v, "kernel_size": 3, "padding": 1, "bias": False},
                       {"op": "batchnorm"}, {"op": "relu"}]
    layers += [{"op": "flatten"}, {"op": "linear", "out_features": 4096}, {"op": "relu"},
               {"op": "linear", "out_features": 4096}, {"op": "relu"}, {"op": "linear", "out_features": 1000}]
    return {"name": "vgg16_bn", "input_shape": [3, image_size, image_size], "layers": layers}


def mlp_doc(width: int = 1024, blocks: int = 4, classes: int = 1000) -> dict[str, Any]:
    """Transformer-MLP-shaped stack on token vectors (batch = tokens): ``blocks`` x (linear 4w, GELU,
    linear w, LayerNorm), then a classifier: GEMM-bound, the shape of a transformer's feed-forward."""
    layers: list[dict[str, Any]] = []
    for _ in range(blocks):
        layers += [{"op": "linear", "out_features": 4 * width}, {"op": "gelu"},
                   {"op": "linear", "out_features": width}, {"op": "layernorm"}]
    layers.append({"op": "linear", "out_features": classes})
    return {"name": f"mlp_{width}x{blocks}", "input_shape": [width], "layers": layers}


def conv1d_doc(channels: int = 256, length: int = 4096, classes: int = 35) -> dict[str, Any]:
    """A 1-D convolutional audio classifier (M5-like, Dai et al. 2017): strided conv1d, BN, ReLU, pooling."""
    layers: list[dict[str, Any]] = [{"op": "conv1d", "out_channels": channels // 2, "kernel_size": 80,
                                     "stride": 4, "bias": False}, {"op": "batchnorm"}, {"op": "relu"},
                                    {"op": "maxpool", "kernel_size": 4}]
    for c in (channels // 2, channels, channels):
        layers += [{"op": "conv1d", "out_channels": c, "kernel_size": 3, "padding": 1, "bias": False},
                   {"op": "batchnorm"}, {"op": "relu"}, {"op": "maxpool", "kernel_size": 4}]
    layers += [{"op": "global_avgpool"}, {"op": "flatten"}, {"op": "linear", "out_features": classes}]
    return {"name": "conv1d_audio", "input_shape": [1, length], "layers": layers}


def _arch(name: str, doc: dict[str, Any], batches: tuple[int, ...], optimizer: str) -> Architecture:
    return Architecture(name, "build_json", {"doc": doc}, batches, optimizer, "JSON layer list (torch.nn), gpu_bench")


#: The six whole models (JSON layer lists built with ``torch.nn`` by :func:`app.profiler.e2e.build_json`).
MODELS: tuple[Architecture, ...] = (
    _arch("vgg11_bn_cifar", vgg11_bn_cifar_doc(), (64, 256), "momentum"),
    _arch("mobilenet_v1_224", mobilenet_v1_doc(224), (32, 128), "momentum"),
    _arch("lstm_lm_ptb_medium", lstm_lm_doc(), (20, 64), "sgd"),
    _arch("vgg16_bn_224", vgg16_bn_doc(224), (16, 64), "momentum"),
    _arch("mlp_1024x4", mlp_doc(), (2048, 8192), "adam"),
    _arch("conv1d_audio", conv1d_doc(), (64, 256), "adam"),
)
SMOKE_MODELS: tuple[Architecture, ...] = (
    _arch("mlp_32x1", mlp_doc(32, 1, 10), (4,), "adam"),
    _arch("conv1d_tiny", conv1d_doc(8, 2048, 5), (2,), "momentum"),
)


@contextlib.contextmanager
def precision_mode(precision: str) -> Iterator[None]:
    """PyTorch's TF32 flags for ``precision`` (module docstring), restored on exit; ``ValueError`` for an
    unknown precision."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def measure_iteration(arch: Architecture, batch: int, *, precision: str, device: str, budget_s: float,
                      warmup: int = 2, reps: int = 10) -> dict[str, Any]:
    """Time training iterations of ``arch`` (forward with the loss, backward, update; CUDA events on a GPU)
    at ``batch`` under ``precision`` (``bf16``: autocast, fp32 weights). Returns the e2e row's measured part:
    ``params``, ``timings`` (phase -> stats) and ``train_step_ms``."""
    import torch

    from app.profiler.e2e import build
    from app.profiler.timing import make_clock, make_optimizer, time_phases

    b = build(arch)
    model = b.module.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(arch.optimizer, params)
    data = {k: v.to(device) for k, v in b.make_batch(batch).items()}
    state: dict[str, Any] = {}
    dev_type = "cuda" if device.startswith("cuda") else "cpu"

    def zero() -> None:
        state.clear()
        opt.zero_grad(set_to_none=True)

    def fwd() -> None:
        with torch.autocast(device_type=dev_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            state["loss"] = b.loss(data)

    phases = [("forward", fwd), ("backward", lambda: state["loss"].backward()), ("update", opt.step)]
    with precision_mode(precision), torch.enable_grad():
        st = time_phases(phases, clock=make_clock(device), warmup=warmup, reps=reps, min_reps=3, budget_s=budget_s,
                         before_rep=zero, total_name="train_step")
    return {"params": sum(p.numel() for p in params), "timings": {k: v.to_dict() for k, v in st.items()},
            "train_step_ms": st["train_step"].to_dict()["median_ms"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.profiler.gpu_bench", description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, required=True, help="folder of the two shards")
    p.add_argument("--tag", default=None, help="shard suffix (default: the device name, lower-cased)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (only with --smoke)")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--n-configs", type=int, default=1000, help="layer configurations (x precisions = kernels)")
    p.add_argument("--max-train-ms", type=float, default=1500.0,
                   help="size cap of a configuration, in the sampler's CPU-estimate ms")
    p.add_argument("--max-seconds", type=float, default=450.0, help="wall-clock bound of the whole session")
    p.add_argument("--kernel-budget-s", type=float, default=0.1, help="budget of one layer measurement")
    p.add_argument("--model-budget-s", type=float, default=2.5, help="budget of one whole-model measurement")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seconds-long CPU run of the same code (tests)")
    return p


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_") or "device"


def _done(path: Path, key: tuple[str, ...]) -> set[tuple[Any, ...]]:
    return {tuple(r.get(k) for k in key) for r in iter_rows(path)} if path.exists() else set()


def _write(fh: Any, row: dict[str, Any]) -> None:
    fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    fh.flush()


def _stamp(row: dict[str, Any], t0: float, ctx: dict[str, Any], granularity: str, precision: str) -> dict[str, Any]:
    import torch

    flags = {"matmul_allow_tf32": precision == "tf32", "cudnn_allow_tf32": True,
             "autocast": "bfloat16" if precision == "bf16" and granularity == "iteration" else None,
             "tensor_dtype": "bfloat16" if precision == "bf16" and granularity == "layer" else "float32"}
    row.update(measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
               load_avg_1m=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
               wall_s=round(time.perf_counter() - t0, 3),
               context={**ctx, "granularity": granularity, "precision_flags": flags,
                        "torch_cuda": torch.version.cuda})
    return row


def main(argv: Sequence[str] | None = None) -> int:
    """Run the session (module docstring); returns 0, or 2 for a CUDA run without a GPU."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    from app.profiler.run import _analytic, _open_for_append
    from app.profiler.sampler import sample_configs
    from app.profiler.timing import device_context, make_clock, measure_config

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for prec in precisions:
        if prec not in PRECISIONS:
            raise SystemExit(f"unknown precision {prec!r}; known: {', '.join(PRECISIONS)}")
    device = "cpu" if args.smoke else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --smoke on CPU", file=sys.stderr)
        return 2
    if not device.startswith("cuda"):
        if not args.smoke:
            raise SystemExit("a CPU run is only the --smoke test; pass --device cuda on a GPU machine")
        precisions = [p for p in precisions if p != "tf32"]  # TF32 is a tensor-core mode: no CPU meaning
    models, families = (SMOKE_MODELS, ("linear", "conv2d", "layernorm", "activation")) if args.smoke \
        else (MODELS, KERNEL_FAMILIES)
    n_configs, max_train_ms = (4, 2.0) if args.smoke else (args.n_configs, args.max_train_ms)
    model_budget_s = min(args.model_budget_s, 0.5) if args.smoke else args.model_budget_s
    ctx = device_context(device)
    ctx["bench"] = "app.profiler.gpu_bench " + " ".join(list(sys.argv[1:] if argv is None else argv))
    tag = args.tag or _slug(str(ctx.get("device_name", device)))
    e2e_path, layer_path = args.out_dir / f"e2e_{tag}.jsonl", args.out_dir / f"layers_{tag}.jsonl"
    t_start = time.perf_counter()

    def left() -> float:
        return args.max_seconds - (time.perf_counter() - t_start)

    done_e2e = _done(e2e_path, ("arch", "batch_size", "precision"))
    with _open_for_append(e2e_path) as fh:
        for arch in models:
            for batch in arch.batches:
                for prec in precisions:
                    if (arch.name, batch, prec) in done_e2e or left() < (1 - MODEL_SHARE) * args.max_seconds:
                        continue
                    t0 = time.perf_counter()
                    row: dict[str, Any] = {
                        "schema": E2E_SCHEMA, "arch": arch.name, "source": arch.source,
                        "builder": f"app.profiler.e2e:{arch.builder}", "builder_config": arch.config, "seed": 0,
                        "batch_size": batch, "precision": prec, "optimizer": arch.optimizer,
                        "graph": arch.config["doc"]}
                    try:
                        row.update(status="ok", error=None, **measure_iteration(
                            arch, batch, precision=prec, device=device, budget_s=model_budget_s))
                    except Exception as exc:  # recorded (out of memory, unsupported dtype); the session goes on
                        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
                    _write(fh, _stamp(row, t0, ctx, "iteration", prec))
                    print(f"{arch.name:<20} b={batch:<5} {prec:<5} {row['status']:<5} "
                          f"{row.get('train_step_ms', float('nan')):9.3f} ms", file=sys.stderr, flush=True)
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()

    configs = sample_configs(n_configs, seed=args.seed, families=families, max_train_ms=max_train_ms)
    done_layers = _done(layer_path, ("config_id", "precision"))
    clock = make_clock(device)
    n_ok = n_err = 0
    with _open_for_append(layer_path) as fh:
        for cfg in configs:
            for prec in precisions:
                if (cfg.config_id, prec) in done_layers:
                    continue
                if left() <= 0:
                    print(f"time limit: {n_ok + n_err} layer rows this run; rerun to resume", file=sys.stderr)
                    return 0
                t0 = time.perf_counter()
                dtype_prec = "bf16" if prec == "bf16" else "fp32"
                row = {"schema": ROW_SCHEMA, **cfg.row_fields(dtype_prec), "precision": prec}
                try:
                    params, flops = _analytic(cfg)
                    with precision_mode(prec):
                        timings = measure_config(cfg, precision=dtype_prec, device=device, clock=clock,
                                                 warmup=2, reps=20, min_reps=3, budget_s=args.kernel_budget_s)
                    row.update(status="ok", error=None, timings={k: v.to_dict() for k, v in timings.items()},
                               forward_ms=timings["forward"].to_dict()["median_ms"],
                               train_step_ms=timings["train_step"].to_dict()["median_ms"])
                    n_ok += 1
                except Exception as exc:  # recorded, the session goes on
                    params, flops = 0, 0
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500], timings={},
                               forward_ms=None, train_step_ms=None)
                    n_err += 1
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                row.update(params=params, forward_flops=flops,
                           measure={"warmup": 2, "reps": 20, "min_reps": 3, "budget_s": args.kernel_budget_s,
                                    "split_backward": False})
                _write(fh, _stamp(row, t0, ctx, "layer", prec))
    print(f"done in {time.perf_counter() - t_start:.0f} s: {n_ok} ok, {n_err} errors -> {layer_path}, {e2e_path}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
