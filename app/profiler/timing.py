"""The timing engine: warm-up, repetitions and robust statistics of separately timed phases.

What is timed (one :class:`~app.profiler.sampler.LayerConfig` → :func:`measure_config`):

* ``forward`` — inference forward: module in ``eval()`` mode under ``torch.no_grad()``.
* one training step, split in three phases timed back to back within the same repetition:
  ``train_forward`` (module in ``train()`` mode, autograd recording), ``backward``
  (``out.backward(grad_out)`` with a fixed random output gradient, so no loss kernel is timed; it
  computes the input gradient when ``needs_input_grad`` and the weight gradients) and ``update``
  (``optimizer.step()``; absent for parameter-free layers). ``train_step`` is their per-repetition
  sum, so its median is the median of sums, not the sum of medians. ``zero_grad(set_to_none=True)``
  runs before each repetition and is not timed.
* optionally (``split_backward``) ``backward_input`` and ``backward_weight``: after one forward,
  ``torch.autograd.grad(out, inputs, grad_out, retain_graph=True)`` then
  ``torch.autograd.grad(out, params, grad_out)``, each timed. Their sum can exceed ``backward``: work
  shared by both (e.g. an LSTM's backward through time, the activation's own gradient) is done twice.

Clocks: on CPU ``time.perf_counter_ns`` around synchronous kernels (threads pinned with
``torch.set_num_threads`` and recorded); on CUDA ``torch.cuda.Event(enable_timing=True)`` recorded on
the current stream between phases, read after ``Event.synchronize()`` of the repetition's last event.
:class:`CudaClock` takes the ``torch.cuda`` namespace as a parameter so its logic is unit-tested with
fakes on machines without a GPU.

Repetitions: ``warmup`` untimed repetitions (at least one, fewer when one repetition already uses most
of the budget), then up to ``reps`` timed ones, stopping early once ``min_reps`` are done and the
phase's wall-clock budget is spent. Statistics: median, quartiles (linear interpolation), min, max,
mean, standard deviation, count.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

# --------------------------------------------------------------------------------------------------
# Statistics and clocks (no torch needed)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings of one phase, milliseconds."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    std_ms: float
    n: int

    @property
    def iqr_ms(self) -> float:
        """Interquartile range (q3 - q1), ms."""
        return self.q3_ms - self.q1_ms

    @property
    def rel_iqr(self) -> float:
        """IQR / median (0 when the median is 0): the relative spread reported in the dataset."""
        return self.iqr_ms / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self, digits: int = 5) -> dict[str, float | int]:
        """JSON-ready dict with values rounded to ``digits`` significant digits."""
        return {k: (_sig(v, digits) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _sig(x: float, digits: int) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Quantile with linear interpolation between order statistics (numpy's default ``linear``)."""
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> Stats:
    """:class:`Stats` of a non-empty sequence of timings (ms). Raises ``ValueError`` when empty."""
    if not samples_ms:
        raise ValueError("no samples to summarize")
    xs = sorted(float(x) for x in samples_ms)
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return Stats(_quantile(xs, 0.5), _quantile(xs, 0.25), _quantile(xs, 0.75), xs[0], xs[-1], mean, std, n)


class Clock(Protocol):
    """Marks points in the device's timeline and measures the time between two marks."""

    kind: str

    def mark(self) -> Any:
        """A point in time (CPU: a timestamp; CUDA: an event recorded on the current stream)."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (waits for ``end`` to complete on asynchronous devices)."""

    def synchronize(self) -> None:
        """Wait until every queued kernel has finished."""


class CpuClock:
    """``time.perf_counter_ns`` clock for synchronous (CPU) execution."""

    kind = "perf_counter_ns"

    def __init__(self, counter: Callable[[], int] = time.perf_counter_ns) -> None:
        self._counter = counter

    def mark(self) -> int:
        return self._counter()

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def synchronize(self) -> None:
        return None


class CudaClock:
    """CUDA-event clock: ``mark`` records a timing event on the current stream; ``elapsed_ms``
    synchronises on the end event, then returns ``start.elapsed_time(end)`` (ms, ~0.5 µs resolution).

    ``cuda`` is the ``torch.cuda`` namespace (injected so the logic can be tested with a fake).
    """

    kind = "cuda_event"

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda

    def mark(self) -> Any:
        ev = self._cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end))

    def synchronize(self) -> None:
        self._cuda.synchronize()


def make_clock(device: str, *, cuda: Any = None) -> Clock:
    """:class:`CudaClock` for a ``cuda`` device, :class:`CpuClock` otherwise."""
    return CudaClock(cuda) if str(device).startswith("cuda") else CpuClock()


Phase = tuple[str, Callable[[], Any]]


def time_phases(
    phases: Sequence[Phase],
    *,
    clock: Clock,
    warmup: int = 3,
    reps: int = 7,
    min_reps: int = 3,
    budget_s: float | None = None,
    before_rep: Callable[[], Any] | None = None,
    total_name: str | None = None,
    wall: Callable[[], float] = time.perf_counter,
) -> dict[str, Stats]:
    """Time ``phases`` (run in order, each a zero-argument callable) over repetitions.

    Each repetition calls ``before_rep`` (untimed), then every phase between clock marks. Warm-up runs
    ``warmup`` untimed repetitions but stops after one when it has used a quarter of ``budget_s``; the
    timed loop stops after ``reps``, or once ``min_reps`` are done and ``budget_s`` (wall clock, from
    the start of the warm-up) is spent. Returns one :class:`Stats` per phase name, plus the
    per-repetition sum of all phases under ``total_name`` when given. Exceptions of the phases propagate.
    """
    if not phases:
        raise ValueError("no phases to time")
    if reps < 1 or min_reps < 1:
        raise ValueError("reps and min_reps must be ≥ 1")
    t0 = wall()

    def run_once() -> list[Any]:
        if before_rep is not None:
            before_rep()
        marks = [clock.mark()]
        for _, fn in phases:
            fn()
            marks.append(clock.mark())
        return marks

    for _ in range(max(1, warmup)):
        marks = run_once()
        clock.elapsed_ms(marks[0], marks[-1])  # waits for the device on asynchronous clocks
        if budget_s is not None and wall() - t0 > budget_s / 4:
            break
    clock.synchronize()

    samples: dict[str, list[float]] = {name: [] for name, _ in phases}
    totals: list[float] = []
    for r in range(reps):
        marks = run_once()
        total = 0.0
        for j, (name, _) in enumerate(phases):
            ms = clock.elapsed_ms(marks[j], marks[j + 1])
            samples[name].append(ms)
            total += ms
        totals.append(total)
        if budget_s is not None and r + 1 >= min_reps and wall() - t0 > budget_s:
            break
    out = {name: summarize(xs) for name, xs in samples.items()}
    if total_name:
        out[total_name] = summarize(totals)
    return out


# --------------------------------------------------------------------------------------------------
# Context of a measurement
# --------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` model name, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_supported(device: str) -> bool:
    """Whether bf16 kernels are native on ``device``: CUDA ``is_bf16_supported()``; CPU oneDNN's
    ``_is_mkldnn_bf16_supported()`` (AVX512-BF16/AMX or AVX512 emulation). False when unknown."""
    import torch

    try:
        if str(device).startswith("cuda"):
            return bool(torch.cuda.is_bf16_supported())
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # an old build without the op: unknown means no
        return False


def device_context(device: str) -> dict[str, Any]:
    """Static context of measurements on ``device`` (stored in every row's ``context``)."""
    import sys

    import torch

    ctx: dict[str, Any] = {
        "device": "cuda" if str(device).startswith("cuda") else "cpu",
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "framework": "torch",
        "framework_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "bf16_supported": bf16_supported(device),
        "timer": make_clock(device, cuda=object()).kind,
    }
    if ctx["device"] == "cuda":
        idx = torch.device(device).index or 0
        ctx.update(
            device_name=torch.cuda.get_device_name(idx),
            cuda_version=torch.version.cuda,
            cudnn_version=torch.backends.cudnn.version(),
            compute_capability=".".join(map(str, torch.cuda.get_device_capability(idx))),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        )
    else:
        ctx["device_name"] = ctx["cpu_model"]
        ctx["cpu_mhz"] = _cpu_mhz()
    return ctx


def record_machine(folder: Path, ctx: Mapping[str, Any]) -> Path | None:
    """Write the measuring CPU's spec to ``folder/hardware.json`` (``layercast import profiler`` stores the
    shards' rows against it, never against the importing machine's ``local``) and return its path.

    The spec is :func:`app.hardware.local.detect_local_cpu` (memory bandwidth measured now, ~0.5 s) under
    the id derived from ``ctx`` (:meth:`app.measurements.profiler_rows.MachineContext.derived_id`, e.g.
    ``cpu-amd-epyc-2c-avx512``). A file already there for this machine (a resumed campaign) is kept, so
    every shard of the folder shares one measurement. Returns None for CUDA contexts (the import names
    the GPU's catalog entry). Raises ``SystemExit`` when the file describes another machine (shards of two
    machines must not share a folder) or is unreadable.
    """
    import dataclasses

    from app.hardware.catalog import spec_to_dict
    from app.hardware.local import detect_local_cpu
    from app.measurements.importers import ImportFormatError
    from app.measurements.profiler_rows import HARDWARE_FILE, MachineContext, read_machine_spec, spec_mismatches

    machine = MachineContext.from_context(ctx)
    if machine.device != "cpu":
        return None
    path = Path(folder) / HARDWARE_FILE
    if path.exists():
        try:
            why = spec_mismatches(read_machine_spec(path), machine)
        except ImportFormatError as exc:
            raise SystemExit(f"{path}: {exc}") from exc
        if why:
            raise SystemExit(f"{path} describes another machine ({'; '.join(why)}): write this machine's shards "
                             "to another folder")
        return path
    spec = dataclasses.replace(detect_local_cpu(), id=machine.derived_id())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(spec_to_dict(spec), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _cpu_mhz() -> float | None:
    """Nominal clock from ``/proc/cpuinfo`` (``cpu MHz`` of the first core), or ``None``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("cpu mhz"):
                    return round(float(line.split(":", 1)[1]), 1)
    except (OSError, ValueError):
        pass
    return None


# --------------------------------------------------------------------------------------------------
# Torch modules from JSON layer specs, and measurement of one configuration
# --------------------------------------------------------------------------------------------------

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ACT_MODULES = {
    "relu": "ReLU", "gelu": "GELU", "sigmoid": "Sigmoid", "tanh": "Tanh", "silu": "SiLU", "swish": "SiLU",
    "leaky_relu": "LeakyReLU", "elu": "ELU", "hardswish": "Hardswish", "softplus": "Softplus", "mish": "Mish",
}


def module_for_spec(spec: Mapping[str, Any], input_shape: Sequence[int]) -> Any:
    """The ``torch.nn`` module of one JSON layer spec applied to a per-sample ``input_shape``.

    Mirrors :func:`app.core.json_import.import_json` (channels-first; ``linear`` on the last axis;
    ``layernorm`` over the last axis; recurrent layers batch-first, returning the output sequence).
    Raises ``ValueError`` for an op without a torch equivalent here.
    """
    import torch
    from torch import nn

    op = str(spec["op"]).lower()
    nd = len(input_shape) - 1
    cls: Any
    if op in ("conv1d", "conv2d", "conv3d", "conv"):
        nd = {"conv1d": 1, "conv2d": 2, "conv3d": 3}.get(op, nd)
        cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
        return cls(input_shape[0], spec["out_channels"], spec["kernel_size"],
                   stride=spec.get("stride", 1), padding=spec.get("padding", 0),
                   dilation=spec.get("dilation", 1), groups=spec.get("groups", 1), bias=spec.get("bias", True))
    if op in ("linear", "dense"):
        return nn.Linear(input_shape[-1], spec["out_features"], bias=spec.get("bias", True))
    if op in _ACT_MODULES:
        return getattr(nn, _ACT_MODULES[op])()
    if op == "batchnorm":
        cls = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[nd]
        return cls(input_shape[0], affine=spec.get("affine", True))
    if op == "instancenorm":
        cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[nd]
        return cls(input_shape[0], affine=spec.get("affine", True))
    if op == "groupnorm":
        return nn.GroupNorm(spec["num_groups"], input_shape[0], affine=spec.get("affine", True))
    if op == "layernorm":
        return nn.LayerNorm(input_shape[-1], elementwise_affine=spec.get("affine", True))
    if op in ("maxpool", "avgpool"):
        k = spec["kernel_size"]
        s = spec.get("stride") or k
        p = spec.get("padding", 0)
        cls = getattr(nn, ("MaxPool" if op == "maxpool" else "AvgPool") + f"{nd}d")
        return cls(k, stride=s, padding=p)
    if op in ("global_avgpool", "global_maxpool"):
        cls = getattr(nn, ("AdaptiveAvgPool" if op == "global_avgpool" else "AdaptiveMaxPool") + f"{nd}d")
        return cls(1)
    if op == "flatten":
        return nn.Flatten()
    if op == "dropout":
        return nn.Dropout(p=float(spec.get("p", 0.1)))
    if op == "softmax":
        return nn.Softmax(dim=-1)
    if op == "embedding":
        return nn.Embedding(spec["num_embeddings"], spec["embedding_dim"])
    if op in ("lstm", "gru", "rnn"):
        rnn_cls: Any = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[op]

        class _Seq(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rnn = rnn_cls(input_shape[-1], spec["hidden_size"], batch_first=True,
                               bidirectional=bool(spec.get("bidirectional", False)))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.rnn(x)[0]

        return _Seq()
    raise ValueError(f"no torch module for op {op!r}")


def shape_after(spec: Mapping[str, Any], input_shape: Sequence[int]) -> tuple[int, ...]:
    """Per-sample output shape of one JSON layer (via :func:`app.core.json_import.import_json`)."""
    from app.core.json_import import import_json

    g = import_json({"input_shape": list(input_shape), "layers": [dict(spec)]}, batch_size=1)
    return tuple(g.layers[0].outputs[0].shape[1:])


def sequential_for_doc(doc: Mapping[str, Any]) -> Any:
    """``torch.nn.Sequential`` of a whole JSON layer-list document (one module per layer)."""
    from torch import nn

    shape = tuple(doc["input_shape"])
    mods = []
    for spec in doc["layers"]:
        mods.append(module_for_spec(spec, shape))
        shape = shape_after(spec, shape)
    return nn.Sequential(*mods)


def make_optimizer(name: str, params: Sequence[Any]) -> Any:
    """``torch.optim`` optimizer for ``name`` (sgd lr 1e-3; momentum 0.9; adam lr 1e-4), default
    implementation (on CPU: the single-tensor for-loop; on CUDA: ``foreach``). ``None`` for "none" or
    no parameters."""
    import torch

    if name == "none" or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, nesterov=name == "nesterov")
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    raise ValueError(f"unknown optimizer {name!r}")


@dataclass
class Case:
    """A configuration made runnable: ``forward()`` runs the op on prepared inputs."""

    forward: Callable[[], Any]
    module: Any
    grad_inputs: list[Any]  # inputs that require a gradient
    params: list[Any]
    grad_out: Any


def build_case(config: Any, *, precision: str = "fp32", device: str = "cpu", seed: int = 0) -> Case:
    """Module, inputs and output gradient of a :class:`~app.profiler.sampler.LayerConfig`.

    Inputs are ``randn`` (indices ``randint`` for embeddings) of the config's shapes in ``precision``
    on ``device``; they require a gradient when ``config.needs_input_grad``.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    dtype = getattr(torch, _TORCH_DTYPES[precision])
    dev = torch.device(device)
    nig = bool(config.needs_input_grad)

    def rand(shape: Sequence[int], grad: bool = nig) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)

    if config.op == "matmul":
        a, b = rand(config.shapes["a"]), rand(config.shapes["b"])
        fwd: Callable[[], Any] = lambda: torch.matmul(a, b)  # noqa: E731
        grads, module = [t for t in (a, b) if t.requires_grad], None
    elif config.op == "attention":
        s = config.shapes
        q = rand((config.batch_size, s["heads"], s["seq_q"], s["head_dim"]))
        k = rand((config.batch_size, s["heads"], s["seq_kv"], s["head_dim"]))
        v = rand((config.batch_size, s["heads"], s["seq_kv"], s["head_dim"]))
        causal = bool(s.get("causal", False))
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        grads, module = [t for t in (q, k, v) if t.requires_grad], None
    else:
        module = module_for_spec(config.spec, config.input_shape).to(device=dev, dtype=dtype)
        shape = (config.batch_size, *config.input_shape)
        if config.op == "embedding":
            x = torch.randint(0, config.spec["num_embeddings"], shape, device=dev)
            grads = []
        else:
            x = rand(shape)
            grads = [x] if x.requires_grad else []
        fwd = lambda: module(x)  # noqa: E731
    params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
    with torch.no_grad():
        out = fwd()
    grad_out = torch.randn_like(out)
    return Case(fwd, module, grads, params, grad_out)


def measure_config(
    config: Any,
    *,
    precision: str = "fp32",
    device: str = "cpu",
    clock: Clock | None = None,
    warmup: int = 3,
    reps: int = 7,
    min_reps: int = 3,
    budget_s: float = 2.0,
    split_backward: bool = False,
) -> dict[str, Stats]:
    """Time one configuration (see module docstring for the passes).

    ``budget_s`` is the wall-clock budget of the whole configuration: 60 % for the training step, 25 %
    for the inference forward, 15 % for the optional backward split. Returns pass name → :class:`Stats`
    (``update`` missing for parameter-free layers). Exceptions (unsupported dtype, out of memory)
    propagate to the caller, which records them.
    """
    import torch

    clock = clock or make_clock(device)
    case = build_case(config, precision=precision, device=device)
    opt = make_optimizer(config.optimizer, case.params)
    state: dict[str, Any] = {}

    def zero() -> None:
        state.clear()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for p in case.params:
            p.grad = None
        for t in case.grad_inputs:
            t.grad = None

    def fwd() -> None:
        state["out"] = case.forward()

    def bwd() -> None:
        state["out"].backward(case.grad_out)

    phases: list[Phase] = [("train_forward", fwd), ("backward", bwd)]
    if opt is not None:
        phases.append(("update", opt.step))
    if case.module is not None:
        case.module.train()
    with torch.enable_grad():
        out = time_phases(phases, clock=clock, warmup=warmup, reps=reps, min_reps=min_reps,
                          budget_s=0.6 * budget_s, before_rep=zero, total_name="train_step")
    zero()

    if case.module is not None:
        case.module.eval()
    with torch.no_grad():
        out.update(time_phases([("forward", case.forward)], clock=clock, warmup=max(1, warmup - 1), reps=reps,
                               min_reps=min_reps, budget_s=0.25 * budget_s))

    if split_backward and case.grad_inputs and case.params:
        if case.module is not None:
            case.module.train()

        def grad_in() -> None:
            torch.autograd.grad(state["out"], case.grad_inputs, case.grad_out, retain_graph=True)

        def grad_w() -> None:
            torch.autograd.grad(state["out"], case.params, case.grad_out)

        with torch.enable_grad():
            split_phases: list[Phase] = [("split_forward", fwd), ("backward_input", grad_in),
                                         ("backward_weight", grad_w)]
            split = time_phases(split_phases, clock=clock, warmup=1, reps=reps, min_reps=min(min_reps, 2),
                                budget_s=0.15 * budget_s, before_rep=zero)
        out["backward_input"] = split["backward_input"]
        out["backward_weight"] = split["backward_weight"]
    zero()
    return out
