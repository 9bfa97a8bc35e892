"""Training and inference memory footprint: what a framework (PyTorch) actually keeps, tensor by tensor.

Model of one training step (forward, backward, optimizer update), from the layer IR alone (op kind, tensors,
a few attributes), each activation tensor identified by its name (views share their base's name):

* **Model state**: weights in fp32 (4 B/param; under fp16/bf16 autocast they are the fp32 master copy);
  gradients fp32 (4 B/param); optimizer state ``states × 4 B/param`` (:data:`app.core.costs.OPTIMIZERS`:
  0 SGD, 1 momentum, 2 Adam/AdamW). Under autocast, every weight a conv/GEMM/matmul/recurrent layer reads
  is also cast once to 16 bits (autocast's weight cache) and that copy is saved for backward (by a GEMM
  only when its input needs a gradient: the copy serves the input gradient).
* **Saved activations**: per layer, exactly the tensors autograd saves (PyTorch ``derivatives.yaml``):
  conv/linear save their input (not their output); matmul both operands; BatchNorm its input plus the
  per-channel ``save_mean``/``save_invstd`` (2 × C × 4 B); LayerNorm its input plus mean and rstd per row;
  ReLU, Sigmoid, Tanh, Exp, Softmax their *output* (so an in-place ReLU after conv/BN adds nothing: its
  output is the tensor the next conv saves anyway); GELU, SiLU, Erf, LeakyReLU, Log, Pow and ReLU6 (Clip:
  torch's ``hardtanh`` keeps its input, measured even for ``inplace=True``) their input;
  Add/Sub/Concat/views/Pad save nothing; Mul/Div save the operands the other gradient needs (nothing for a
  constant); Dropout a bool mask (1 B/element) on a GPU (``native_dropout``), a mask of the input's type on
  a CPU (``input * bernoulli``); MaxPool its input plus int64 indices;
  AveragePool its input, GlobalAveragePool nothing (a mean); an embedding its indices. Attention follows
  ``scaled_dot_product_attention`` as flash/memory-efficient kernels run it: a ``MatMul → (scale, mask)
  → Softmax → (Dropout) → MatMul`` chain (or a fused Attention op) keeps only Q, K, V, the output O and the
  fp32 log-sum-exp per query row; the S×S scores are recomputed. Recurrent layers keep input, output
  and the fused kernel's workspace (:data:`RECURRENT_WORKSPACE_PER_OUTPUT`). A tensor saved by several
  layers is counted once.
* **Autocast dtypes** (fp16/bf16, ``torch.autocast``): conv/GEMM/matmul/attention/recurrent layers run in
  16 bits (a 32-bit input is cast: the 16-bit copy is what they save) and write 16-bit outputs; on CUDA the
  ops of autocast's fp32 list (:data:`CUDA_AUTOCAST_FP32_OPS`: softmax, layer/group norm, pow, exp, log...)
  run in fp32; every other op keeps its inputs' precision (a 32-bit operand promotes, a bias add does
  not). The CPU autocast's fp32 list holds none of the ops above (measured: softmax, layer norm, pow stay
  bf16 on CPU).
* **Loss**: cross-entropy on the graph's first output (classes on the last axis), as classifiers and
  language models train: ``log_softmax`` saves its fp32 output (autocast runs it in fp32), and its
  backward holds two fp32 gradients of the output's size at once. A graph that ends in its own
  ``Softmax``/``LogSoftmax`` (or in views of its output) has run that softmax already
  (:func:`app.core.analysis.loss_layer`): its loss is NLL on that output, which keeps nothing of
  its own beyond the output's gradient.
* **Peak**: the end-of-forward live set (model state + saved activations + the model's output) is followed
  by a reverse walk over the layers: at each layer's backward, live = model state + the saved tensors of
  layers not yet back-propagated + the gradients of the weights already reached (fp32) + the activation
  gradients in flight (produced, not yet consumed by their producer's backward: residual branches keep
  theirs) + the layer's transient (cuDNN workspace for a conv on a GPU). The optimizer step adds its
  temporaries (a parameter-sized fp32 buffer for Adam-like foreach updates on a GPU; on a CPU, where the
  update runs tensor by tensor, two buffers the size of the largest parameter: ``sqrt`` then ``/``).
  ``total_bytes`` = max over those instants + device runtime (below). This is
  "weights + grads + optimizer state + saved activations at the end of forward + the largest transient
  in backward", made step by step because saved activations are released while gradients accumulate.
* **Device runtime** (:data:`DEVICE_RUNTIME`, per vendor generation, GPUs only): the CUDA/HIP context that
  the caching allocator never sees, the cuBLAS workspace, and allocator rounding (every block rounded up
  to 512 B, blocks of 10 MiB and more to 2 MiB: ``c10/cuda/CUDACachingAllocator.cpp``).
* **Data parallel** (``data_parallel=True``: one device of a ``DistributedDataParallel`` job, PyTorch's
  defaults): DDP all-reduces its own flat bucket buffers, allocated when the model is wrapped and kept
  for the whole step, and with ``gradient_as_bucket_view=False`` (the default) they are a copy of every
  gradient beside the ``.grad`` tensors: one more fp32 copy of the gradients, in buckets of 25 MiB
  (``bucket_cap_mb``; the first 1 MiB) filled in the order backward completes them (:func:`ddp_bucket_sizes`),
  each one allocation. The PyTorch docs on ``gradient_as_bucket_view``: views into the buckets "can reduce
  peak memory usage, where the saved memory size will be equal to the total gradients size".
* **Activation checkpointing** (``activation_checkpointing=True``): the layers are cut into ⌈√L⌉
  segments of similar saved size (Chen et al. 2016, "Training deep nets with sublinear memory cost");
  forward keeps only each segment's input; backward recomputes one segment at a time, so the saved set
  is the segment boundaries plus the largest segment's own saved tensors.
* **Inference**: weights plus the largest input+output pair of any single layer (activations are freed as
  soon as they are consumed); under fp16/bf16 autocast, weights the graph stores in 16 bits count 2 bytes (a
  model held in fp16 runs as stored), others 4.

Validated against torch's real peak on CPU (10 architectures × 3 batch sizes × fp32/bf16 autocast) in
docs/memory_validation.md (``scripts/measure_memory.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from app.core.analysis import GraphAnalysis, loss_input, loss_on_probabilities
from app.core.costs import OPTIMIZERS, VIEW_OPS
from app.core.hardware import HardwareSpec, per_spec
from app.core.ir import BYTES_PER_ELEMENT, Layer, OpKind, Tensor
from app.core.precision import AUTOCAST_DTYPES

# Usable share of device memory once context, workspace and rounding are counted: the caching allocator's
# fragmentation (blocks split and cached but not reusable for a given size), a few % in steady training.
HEADROOM = 0.95

# precision → bytes per activation element under autocast (None: activations as the graph declares them)
PRECISIONS: dict[str, int | None] = {"fp32": None, "tf32": None, "fp16": 2, "bf16": 2}  # tf32: fp32 storage

MIB = 2**20

# DistributedDataParallel's bucket size limits with its defaults (torch/nn/parallel/distributed.py): the first
# bucket closes at dist._DEFAULT_FIRST_BUCKET_BYTES, every later one at bucket_cap_mb=25 (MiB).
DDP_FIRST_BUCKET_BYTES = 1 * MIB
DDP_BUCKET_CAP_BYTES = 25 * MIB


@dataclass(frozen=True, slots=True)
class DeviceRuntime:
    """Memory a framework needs on a device beyond tensors: context, library workspace, allocator rounding.

    ``context_bytes`` is the driver context (CUDA/HIP) plus the framework's loaded kernels, outside the
    caching allocator; ``workspace_bytes`` the cuBLAS (hipBLAS) workspace per handle; ``block_bytes``
    the allocator's block granularity (1: no rounding); ``large_block_bytes`` the rounding of blocks of
    ``large_from_bytes`` and more. ``source`` says where the numbers come from.
    """

    context_bytes: int
    workspace_bytes: int
    block_bytes: int
    large_block_bytes: int
    large_from_bytes: int
    source: str

    def rounded(self, nbytes: int) -> int:
        """``nbytes`` as the caching allocator hands it out (block-rounded)."""
        if self.block_bytes <= 1 or nbytes <= 0:
            return nbytes
        r = -(-nbytes // self.block_bytes) * self.block_bytes
        if r >= self.large_from_bytes:
            r = -(-r // self.large_block_bytes) * self.large_block_bytes
        return r


_ALLOC = "c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize 512 B, kRoundLarge 2 MiB from kMinLargeAlloc 10 MiB"
_CONTEXT = ("CUDA context with lazy module loading (CUDA >= 11.7, PyTorch's default) as nvidia-smi minus "
            "torch.cuda.memory_reserved() right after the first kernel: ~300 MiB on Pascal-Turing, more on "
            "newer generations with larger kernel images; 700+ MiB without lazy loading "
            "(discuss.pytorch.org/t/high-gpu-memory-overhead/81330)")
_CUBLAS = "cuBLAS docs, cublasSetWorkspace: 4 MiB recommended before Hopper, 32 MiB on Hopper"

# vendor generation (first word of HardwareSpec.architecture, lower case) → runtime. Every GPU constant of
# the footprint lives here; CPUs have none (no context, the CPU allocator does not round).
DEVICE_RUNTIME: dict[str, DeviceRuntime] = {
    **{gen: DeviceRuntime(300 * MIB, 4 * MIB, 512, 2 * MIB, 10 * MIB, f"{_CONTEXT}; {_CUBLAS}; {_ALLOC}")
       for gen in ("kepler", "maxwell", "pascal", "volta", "turing")},
    "ampere": DeviceRuntime(400 * MIB, 4 * MIB, 512, 2 * MIB, 10 * MIB, f"{_CONTEXT}; {_CUBLAS}; {_ALLOC}"),
    "ada": DeviceRuntime(450 * MIB, 4 * MIB, 512, 2 * MIB, 10 * MIB, f"{_CONTEXT}; {_CUBLAS}; {_ALLOC}"),
    "hopper": DeviceRuntime(500 * MIB, 32 * MIB, 512, 2 * MIB, 10 * MIB, f"{_CONTEXT}; {_CUBLAS}; {_ALLOC}"),
    "blackwell": DeviceRuntime(500 * MIB, 32 * MIB, 512, 2 * MIB, 10 * MIB, f"{_CONTEXT}; {_CUBLAS}; {_ALLOC}"),
    "cdna": DeviceRuntime(400 * MIB, 4 * MIB, 512, 2 * MIB, 10 * MIB,
                          "ROCm HIP context, same order as CUDA's; PyTorch's caching allocator is shared "
                          f"by HIP ({_ALLOC}); hipBLAS workspace as cuBLAS'"),
}
GPU_DEFAULT_RUNTIME = DEVICE_RUNTIME["hopper"]  # unknown generation: the largest known context (safe side)
CPU_RUNTIME = DeviceRuntime(0, 0, 1, 1, 1, "CPU: no device context; the CPU allocator does not round blocks")

# CUDA autocast's fp32 list (torch/csrc/autograd/autocast_mode / aten/src/ATen/autocast_mode.cpp), the ONNX
# op types among it: these run (and save) in fp32 under fp16/bf16 autocast on a GPU.
CUDA_AUTOCAST_FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "GroupNormalization", "InstanceNormalization", "Pow",
    "Exp", "Log", "Reciprocal", "Softplus", "ReduceSum", "ReduceProd", "ReduceL2", "ReduceSumSquare", "Erf",
})

# Workspace of a fused recurrent training kernel, per element of its output sequence (T·B·dirs·H), as
# (tensors in the compute precision, fp32 tensors). LSTM measured with saved-tensor hooks on torch 2.13's
# CPU kernel (oneDNN): 62 B/element in fp32, 44 B/element under bf16 autocast → 9 + 6.5; GRU and RNN
# scaled by their gate count (3/4, 1/4). cuDNN's reserve space is not measured here.
RECURRENT_WORKSPACE_PER_OUTPUT: dict[str, tuple[float, float]] = {
    "LSTM": (9.0, 6.5), "GRU": (6.75, 4.875), "RNN": (2.25, 1.625),
}

_MAC_KINDS = frozenset({OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM, OpKind.MATMUL, OpKind.ATTENTION,
                        OpKind.RECURRENT})
_SAVES_OUTPUT = frozenset({"Relu", "Sigmoid", "Tanh", "Exp", "Sqrt", "Reciprocal", "Elu", "Selu",
                           "Softmax", "LogSoftmax", "HardSigmoid"})
_SAVES_NOTHING = frozenset({"Neg", "Cast", "Add", "Sub", "Sum", "Mean", "Equal", "Less", "Greater", "And", "Or",
                            "Not", "ReduceMean", "ReduceSum", "GlobalAveragePool"})
_ATTENTION_CHAIN_OPS = frozenset({"Div", "Mul", "Add", "Sub", "Where", "Softmax", "Dropout", "Cast"})


def _attr(layer: Layer, key: str, default: Any) -> Any:
    """The one place this module reads a layer attribute: a field of the layer's typed attribute record
    (:data:`app.core.ir.ATTRS_FOR_KIND`), ``default`` when the record (or the field) is absent."""
    return getattr(layer.attrs, key, default)


@dataclass(frozen=True, slots=True)
class MemoryFootprint:
    """Bytes per component of one step and its peak.

    ``weights_bytes`` fp32 parameters (the master copy under autocast; in inference under autocast, weights the
    graph stores in fp16/bf16 count their own 2 bytes, as a model held in 16 bits runs); ``weight_copies_bytes``
    autocast's 16-bit weight cache; ``gradients_bytes`` fp32 weight gradients; ``optimizer_state_bytes`` fp32 state;
    ``activations_bytes`` what is saved for backward at the end of forward (including the model output);
    ``backward_transient_bytes`` the peak's excess over the end of forward (activation gradients in
    flight, workspace) or the optimizer step's temporaries; ``runtime_bytes`` context + library
    workspace; ``ddp_gradient_buckets_bytes`` DistributedDataParallel's flat all-reduce buckets (data
    parallel training: one more fp32 copy of every gradient, resident for the whole step; 0 on one device).
    ``total_bytes`` is the predicted peak: model state + ``peak_live_bytes`` + runtime.
    ``checkpoint_bytes`` is not on the device: the file ``torch.save`` writes of the fp32 weights and the
    optimizer state (parameters × 4 B × (1 + states per parameter), the tensors' own bytes, pickle framing
    left out), the same on every device, where the components above carry the caching allocator's block
    rounding (:meth:`DeviceRuntime.rounded`).
    """

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    weight_copies_bytes: int = 0
    backward_transient_bytes: int = 0
    runtime_bytes: int = 0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    checkpoint_bytes: int = 0
    ddp_gradient_buckets_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Predicted peak: weights + optimizer state + the largest live set of the step + device runtime (+ the
        DDP buckets)."""
        return (self.weights_bytes + self.optimizer_state_bytes + self.weight_copies_bytes + self.activations_bytes
                + self.backward_transient_bytes + self.runtime_bytes + self.ddp_gradient_buckets_bytes)

    @property
    def model_state_bytes(self) -> int:
        """What does not scale with the batch: weights, weight copies, gradients, optimizer state, runtime, DDP
        buckets."""
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes + self.weight_copies_bytes
                + self.runtime_bytes + self.ddp_gradient_buckets_bytes)


def runtime_for(hardware: HardwareSpec | None) -> DeviceRuntime:
    """Device runtime constants for ``hardware`` (:data:`CPU_RUNTIME` for a CPU or ``None``).

    A GPU is looked up by the first word of its ``architecture`` ("Volta (GV100)" → ``volta``; "Ada
    Lovelace" → ``ada``; "CDNA 3" → ``cdna``); an unknown or missing generation gets
    :data:`GPU_DEFAULT_RUNTIME` (the largest context known, never zero).
    """
    if hardware is None or hardware.kind != "gpu":
        return CPU_RUNTIME
    gen = (hardware.architecture or "").split(" ")[0].split("(")[0].strip().lower()
    return DEVICE_RUNTIME.get(gen, GPU_DEFAULT_RUNTIME)


def device_key(hardware: HardwareSpec | None) -> tuple[DeviceRuntime, bool]:
    """What of ``hardware`` :func:`footprint` depends on: its runtime (:func:`runtime_for`) and whether it
    is a GPU (the autocast op lists). Two devices with equal keys have equal footprints for every graph and
    option, so a memo of footprints can be keyed by this instead of by the whole spec. Computed once per spec
    object (:func:`app.core.hardware.per_spec`): every footprint of a largest-batch search reads it."""
    if hardware is None:
        return _device_key(None)
    return per_spec(_DEVICE_KEYS, hardware, _device_key)


_DEVICE_KEYS: dict[int, tuple[HardwareSpec, Any]] = {}


def _device_key(hardware: HardwareSpec | None) -> tuple[DeviceRuntime, bool]:
    return runtime_for(hardware), hardware is not None and hardware.kind == "gpu"


_FOOTPRINT_KEYS: dict[int, tuple[HardwareSpec, Any]] = {}


def _footprint_key(hardware: HardwareSpec | None) -> tuple[int, int, int, int, int, bool]:
    r, gpu = device_key(hardware)
    return r.context_bytes, r.workspace_bytes, r.block_bytes, r.large_block_bytes, r.large_from_bytes, gpu


def footprint_key(hardware: HardwareSpec | None) -> tuple[int, int, int, int, int, bool]:
    """:func:`device_key` by value: the runtime's numbers (context, workspace, allocator blocks) without the text
    saying where they come from, and whether the device is a GPU. Footprints read nothing else of the device, so
    devices with equal keys have equal footprints even when their runtimes are documented apart (a ROCm device
    and a CUDA one with the same constants): a memo of footprints keyed by it serves both. Computed once per
    spec object (:func:`app.core.hardware.per_spec`): a prediction's memo keys of footprints read it per batch."""
    if hardware is None:
        return _footprint_key(None)
    return per_spec(_FOOTPRINT_KEYS, hardware, _footprint_key)


# ------------------------------------------------------------------------------------------ tensor model
@dataclass(slots=True)
class _Plan:
    """Per-layer saved keys and extra bytes, tensor sizes, producers and consumers (canonical names)."""

    nbytes: dict[str, int]
    saved: list[set[str]]
    extra: list[int]
    produced: list[set[str]]
    consumed: list[set[str]]
    needs_grad: set[str]
    transient: list[int]


def _is_float(t: Tensor) -> bool:
    return t.dtype.startswith(("float", "bfloat"))


# A byte count of the walk, before the batch is known: ("t", numel, bytes per element, is a weight) is a
# tensor (an activation's element count scales with the batch, a weight's does not), ("r", bytes, per batch)
# a buffer; both are rounded as the allocator hands them out (:meth:`DeviceRuntime.rounded`).
_Size = tuple[str, float, int, bool]


class _Terms:
    """A sum of ``coefficient × size`` terms (the extra bytes a layer saves), evaluated at a batch later;
    supports the ``+``, ``sum`` and integer ``*`` the walk writes, so it reads like the integers it stands for."""

    __slots__ = ("terms",)

    def __init__(self, terms: tuple[tuple[int, _Size], ...] = ()) -> None:
        self.terms = terms

    def __add__(self, other: object) -> _Terms:
        if isinstance(other, _Terms):
            return _Terms(self.terms + other.terms)
        if other == 0:
            return self
        return NotImplemented

    __radd__ = __add__

    def __mul__(self, k: int) -> _Terms:
        return _Terms(tuple((c * k, size) for c, size in self.terms))

    __rmul__ = __mul__


@dataclass(slots=True)
class Layout:
    """What :func:`footprint`'s walk over the layers finds that does not depend on the batch size (aliases,
    autocast dtypes, what each layer saves, producers and consumers) with every byte count kept as a
    :data:`_Size` to evaluate at a batch: built once per graph, precision and device kind (``gpu``: the
    autocast op lists and the cuDNN workspace; the generation's allocator rounding is applied when sized) by
    :func:`memory_layout`, then sized per batch and device without walking the layers again."""

    sizes: dict[str, _Size]
    saved: list[set[str]]
    extra: list[_Terms | int]
    produced: list[set[str]]
    consumed: list[set[str]]
    needs_grad: set[str]
    transient: list[tuple[_Size, ...] | None]
    half: int | None
    gpu: bool
    walk: _Walk | None = None  # the walk without checkpointing, compiled by the first footprint that needs it
    ddp_buckets: tuple[int, ...] | None = None  # ddp_bucket_sizes of the layers, by the first footprint that needs it


def _bytes(size: _Size, scale: float, runtime: DeviceRuntime) -> int:
    if size[0] == "t":
        _, numel, per, weight = size
        return runtime.rounded((int(numel) if weight else int(numel * scale)) * per)
    _, nbytes, _, per_batch = size
    return runtime.rounded(int(nbytes * scale) if per_batch else int(nbytes))


def _sized(layout: Layout, scale: float, runtime: DeviceRuntime) -> _Plan:
    """The :class:`_Plan` of ``layout`` at ``scale`` (batch / the graph's batch), blocks rounded as ``runtime``'s
    allocator rounds them."""
    nbytes = {k: _bytes(v, scale, runtime) for k, v in layout.sizes.items()}
    extra = [sum(c * _bytes(size, scale, runtime) for c, size in e.terms) if isinstance(e, _Terms) else e
             for e in layout.extra]
    transient = [0 if t is None else min(sum(_bytes(size, scale, runtime) for size in t), 1024 * MIB)
                 for t in layout.transient]
    return _Plan(nbytes, layout.saved, extra, layout.produced, layout.consumed, layout.needs_grad, transient)


def memory_layout(analysis: GraphAnalysis, *, precision: str = "fp32", hardware: HardwareSpec | None = None
                  ) -> Layout:
    """The batch-independent part of :func:`footprint`'s training walk for ``precision`` (a key of
    :data:`PRECISIONS`) on a device of ``hardware``'s kind (GPU or not: every GPU shares one layout, its
    runtime rounds the bytes when :func:`footprint` sizes it); pass it to :func:`footprint` (and
    :func:`largest_batch_that_fits`) to size many batches and devices of one graph without walking its layers
    each time. Raises ``KeyError`` for an unknown precision."""
    half = PRECISIONS[precision]
    weights = {w.name for layer in analysis.graph.layers for w in layer.weights}
    return _plan(analysis.graph.layers, analysis.graph.outputs, half=half, gpu=device_key(hardware)[1],
                 weight_names=weights)


def _plan(layers: Sequence[Layer], outputs: Iterable[Tensor], *, half: int | None,
          gpu: bool, weight_names: set[str]) -> Layout:
    """Walk the layers in order: alias views, assign autocast dtypes, list what each layer saves."""
    alias: dict[str, str] = {}
    is16: dict[str, bool] = {}
    nbytes: dict[str, _Size] = {}
    needs_grad: set[str] = set()
    n = len(layers)
    saved: list[set[str]] = [set() for _ in range(n)]
    extra: list[_Terms | int] = [0] * n
    produced: list[set[str]] = [set() for _ in range(n)]
    consumed: list[set[str]] = [set() for _ in range(n)]
    transient: list[tuple[_Size, ...] | None] = [None] * n

    def canon(name: str) -> str:
        return alias.get(name, name)

    def size(t: Tensor, sixteen: bool) -> _Size:
        own = BYTES_PER_ELEMENT.get(t.dtype, 4)  # activations carry the batch, weights do not
        return ("t", t.numel, half if (sixteen and half and _is_float(t)) else own, t.name in weight_names)

    def rnd(nbytes: float, per_batch: bool = True) -> _Terms:
        return _Terms(((1, ("r", nbytes, 0, per_batch)),))

    def key(t: Tensor, sixteen: bool | None = None) -> str:
        """Key of ``t`` as stored (``sixteen=None``) or as a copy cast to 16/32 bits; registers its size."""
        c = canon(t.name)
        stored16 = is16.get(c, False)
        want = stored16 if sixteen is None or not _is_float(t) or not half else sixteen
        k = c if want == stored16 else f"{c}@{'16' if want else '32'}"
        nbytes.setdefault(k, size(t, want))
        return k

    fused = _fused_attention(layers)
    for i, layer in enumerate(layers):
        ins, outs, op, kind = layer.inputs, layer.outputs, layer.op_type, layer.kind
        for t in ins:
            consumed[i].add(canon(t.name))
            nbytes.setdefault(canon(t.name), size(t, is16.get(canon(t.name), False)))  # graph inputs
        grad = bool(layer.weights) or any(canon(t.name) in needs_grad for t in ins)
        # dtype of this layer's compute under autocast
        if not half:
            out16 = False
        elif kind in _MAC_KINDS:
            out16 = True
        elif gpu and op in CUDA_AUTOCAST_FP32_OPS or kind is OpKind.EMBEDDING or not any(_is_float(t) for t in ins):
            out16 = False
        else:
            # a 16-bit activation times/plus an fp32 parameter promotes to fp32 (ViT's position embedding),
            # except a bias (1-D) added to a GEMM's output, which torch fuses into the 16-bit GEMM
            promote = any(_is_float(w) and w.numel > 1 and (op in ("Mul", "Div") or len(w.shape) > 1)
                          for w in layer.weights)
            out16 = not promote and all(is16.get(canon(t.name), False) for t in ins if _is_float(t))
        if op in VIEW_OPS and ins and outs:  # views share their base's storage
            for o in outs:
                alias[o.name] = canon(ins[0].name)
        else:
            for o in outs:
                c = canon(o.name)
                is16[c] = out16 and _is_float(o)
                nbytes[c] = size(o, is16[c])
                produced[i].add(c)
                if grad and _is_float(o):
                    needs_grad.add(c)
        if layer.kind is OpKind.UNSUPPORTED:
            continue
        grad_in = any(canon(t.name) in needs_grad for t in ins)
        s, e = _saved_by(layer, i, fused, key=key, rnd=rnd, half=half, out16=out16, grad_in=grad_in, gpu=gpu)
        saved[i] |= s
        extra[i] += e
        if gpu and kind in (OpKind.CONV, OpKind.CONV_TRANSPOSE) and outs:
            transient[i] = tuple(nbytes[canon(o.name)] for o in outs)  # cuDNN workspace (capped at 1 GiB)
    for t in outputs:  # the model output is alive until backward has consumed its gradient
        nbytes.setdefault(canon(t.name), ("r", t.nbytes, 0, True))
    return Layout(nbytes, saved, extra, produced, consumed, needs_grad, transient, half, gpu)


def _fused_attention(layers: Sequence[Layer]) -> dict[int, tuple[int, int]]:
    """Decomposed attention chains ``MatMul(Q, Kᵀ) → scale/mask → Softmax → (Dropout) → MatMul(P, V)``.

    Returns ``{index: (first matmul index, second matmul index)}`` for every layer of a chain. A chain
    follows single-output links through :data:`_ATTENTION_CHAIN_OPS` and must contain one Softmax.
    """
    consumers: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        for t in layer.inputs:
            consumers.setdefault(t.name, []).append(i)
    found: dict[int, tuple[int, int]] = {}
    for i, layer in enumerate(layers):
        if layer.kind is not OpKind.MATMUL or len(layer.inputs) < 2 or not layer.outputs:
            continue
        chain, cur, softmax = [i], layer, False
        while True:
            nxt = consumers.get(cur.outputs[0].name, []) if cur.outputs else []
            if len(nxt) != 1:
                break
            j = nxt[0]
            cand = layers[j]
            if cand.kind is OpKind.MATMUL and softmax and cand.inputs and cand.inputs[0].name == cur.outputs[0].name:
                for k in (*chain, j):
                    found[k] = (i, j)
                break
            if cand.op_type not in _ATTENTION_CHAIN_OPS:
                break
            softmax |= cand.op_type == "Softmax"
            chain.append(j)
            cur = cand
    return found


def _saved_by(layer: Layer, i: int, fused: dict[int, tuple[int, int]], *, key: Callable[..., str],
              rnd: Callable[..., _Terms], half: int | None, out16: bool, grad_in: bool,
              gpu: bool) -> tuple[set[str], _Terms | int]:
    """Keys of the tensors ``layer`` saves for backward and the bytes of saved buffers it creates."""
    ins, outs, op, kind = layer.inputs, layer.outputs, layer.op_type, layer.kind
    f_ins = [t for t in ins if _is_float(t)]
    s: set[str] = set()
    extra: _Terms | int = 0
    cast = True if (half and kind in _MAC_KINDS) else (False if half and gpu and op in CUDA_AUTOCAST_FP32_OPS
                                                          else None)
    # addmm/mm keep the weight only for the input gradient; convolution keeps it whatever its input
    if half and kind in _MAC_KINDS and (grad_in or kind is not OpKind.GEMM):
        for w in layer.weights:
            if _is_float(w) and len(w.shape) > 1:
                s.add(key(w, True))  # autocast's cached 16-bit copy, saved by the layer
    if i in fused:
        first, second = fused[i]
        if i == first:
            s |= {key(t, cast) for t in ins}  # Q, K
            q = ins[0]
            rows = q.numel // q.shape[-1] if q.shape else 1
            extra += rnd(4 * rows)  # log-sum-exp per query row, fp32
        elif i == second:
            s |= {key(t, cast) for t in ins[1:]}  # V
            s |= {key(t) for t in outs}  # O
        elif op in ("Add", "Where") and len(ins) > 1:
            s |= {key(t) for t in ins[1:]}  # the mask (broadcast, small)
        return s, extra
    if kind is OpKind.ATTENTION:
        s |= {key(t, cast) for t in ins} | {key(t) for t in outs}
        if ins and ins[0].shape:
            x = ins[0]  # (B, H, S, D) (opset 23) or (B, S, H·D) with a heads attribute (com.microsoft)
            heads = 1 if len(x.shape) == 4 else int(_attr(layer, "heads", 1) or 1)
            extra += rnd(4 * heads * (x.numel // x.shape[-1]))
        return s, extra
    if kind in (OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM):
        s |= {key(t, cast) for t in f_ins[:1]}
        if not f_ins and ins:
            s.add(key(ins[0]))
        return s, extra
    if kind is OpKind.MATMUL:
        return {key(t, cast) for t in ins}, extra
    if kind is OpKind.RECURRENT:
        s |= {key(t, cast) for t in f_ins[:1]} | {key(t) for t in outs[:1]}
        w16, w32 = RECURRENT_WORKSPACE_PER_OUTPUT.get(op, (9.0, 6.5))
        elems = outs[0].numel if outs else 0
        extra += rnd(int(elems * (w16 * (half or 4) + w32 * 4)))
        return s, extra
    if kind is OpKind.EMBEDDING:
        return {key(t) for t in ins if not _is_float(t)}, extra
    if kind is OpKind.BATCHNORM:
        s |= {key(t, cast) for t in f_ins[:1]}
        channels = ins[0].shape[1] if ins and len(ins[0].shape) > 1 else 1
        return s, extra + 2 * rnd(4 * channels, per_batch=False)  # save_mean, save_invstd (fp32)
    if kind is OpKind.NORM:
        s |= {key(t, cast) for t in f_ins[:1]}
        xn = ins[0] if ins else None
        if xn is None or not xn.shape:
            return s, extra
        if op == "LayerNormalization":
            rows = math.prod(xn.shape[:-1])  # statistics per row of the last axis (nn.LayerNorm's normal use)
        elif op == "LRN":
            return s | {key(t) for t in outs}, extra
        else:
            rows = math.prod(xn.shape[:2])  # Instance/GroupNorm: at most one statistic per (sample, channel)
        return s, extra + 2 * rnd(4 * rows)  # mean and rstd, fp32
    if kind is OpKind.DROPOUT:
        # CUDA's fused native_dropout keeps a bool mask; the CPU path multiplies by a mask of the input's type
        per = 1 if gpu else (half if out16 and half else 4)
        return s, sum(rnd(t.numel * per) for t in outs[:1])
    if kind is OpKind.POOL:
        s |= {key(t) for t in ins[:1]}
        if op == "MaxPool":
            extra += sum(rnd(8 * t.numel) for t in outs[:1])  # int64 indices
        elif op == "LpPool":
            s |= {key(t) for t in outs}
        return s, extra
    if kind is OpKind.GLOBAL_POOL:
        if op == "GlobalMaxPool":
            s |= {key(t) for t in ins[:1]}
            extra += sum(rnd(8 * t.numel) for t in outs[:1])
        return s, extra
    if op in _SAVES_NOTHING or kind is OpKind.DATA_MOVEMENT:
        if op in ("GatherElements", "ScatterND", "Gather"):
            return {key(t) for t in ins if not _is_float(t)}, extra
        return s, extra
    if op in _SAVES_OUTPUT:
        return {key(t, cast) for t in outs[:1]}, extra
    if op in ("Mul", "Div"):
        if len(f_ins) >= 2:
            return {key(t) for t in f_ins}, extra
        if layer.weights:  # activation × parameter: the weight gradient needs the activation
            return {key(t) for t in f_ins}, extra
        return s, extra  # × or ÷ a constant: nothing of batch size
    if op == "Where":
        return {key(t) for t in ins if t.dtype == "bool"}, extra
    if kind is OpKind.REDUCE:
        return {key(t) for t in ins[:1]} | ({key(t) for t in outs} if op != "ReduceSumSquare" else set()), extra
    # the rest (GELU, SiLU, Erf, LeakyReLU, Log, Pow, Abs, Max, Min, PRelu, ...) save their inputs
    return {key(t, cast) for t in f_ins}, extra


# ------------------------------------------------------------------------------------------ footprint
def _checkpoint(plan: _Plan, n: int) -> tuple[list[set[str]], list[int]]:
    """Saved keys/extras per layer under √L-segment activation checkpointing (see module docstring)."""
    costs = [sum(plan.nbytes[k] for k in plan.saved[i]) + plan.extra[i] for i in range(n)]
    segments = max(1, math.ceil(math.sqrt(n)))
    target = sum(costs) / segments if segments else 0
    bounds, acc = [0], 0.0
    for i, c in enumerate(costs):
        acc += c
        if acc >= target and i + 1 < n and len(bounds) < segments:
            bounds.append(i + 1)
            acc = 0.0
    bounds.append(n)
    kept: list[set[str]] = [set() for _ in range(n)]
    kept_extra = [0] * n
    largest, largest_keys = 0, set()
    for a, b in zip(bounds, bounds[1:], strict=False):
        inner: set[str] = set().union(*plan.saved[a:b]) if b > a else set()
        inner_bytes = sum(plan.nbytes[k] for k in inner) + sum(plan.extra[a:b])
        if inner_bytes > largest:
            largest, largest_keys = inner_bytes, inner
        if b > a:
            # the segment's input(s): what its first layer reads (the checkpoint's argument)
            kept[a] |= plan.consumed[a]
    # one segment's recomputed activations are alive at a time during backward: its worst case sits in the
    # first layer's slot so that the reverse walk counts it until the end of backward's last segment
    kept[0] |= largest_keys
    kept_extra[0] += largest - sum(plan.nbytes[k] for k in largest_keys)
    return kept, kept_extra


def footprint(
    analysis: GraphAnalysis,
    *,
    mode: str,
    optimizer: str,
    precision: str = "fp32",
    hardware: HardwareSpec | None = None,
    activation_checkpointing: bool = False,
    batch_size: int | None = None,
    layout: Layout | None = None,
    data_parallel: bool = False,
) -> MemoryFootprint:
    """Peak memory of one step of ``analysis.graph`` at its batch size, by component, in bytes.

    ``mode`` is ``training`` or ``inference``; ``optimizer`` a key of :data:`OPTIMIZERS`; ``precision``
    ``fp32``/``tf32`` (activations as the graph declares them) or ``fp16``/``bf16`` (torch autocast: see
    the module docstring); ``hardware`` decides the device runtime (:func:`runtime_for`; ``None`` = CPU)
    and the autocast op lists. ``activation_checkpointing`` recomputes activations in backward (training
    only). ``batch_size`` (default: the graph's) rescales every activation tensor linearly from the
    graph's batch (each carries the batch axis), so other batches need no re-import. ``layout``: the
    :func:`memory_layout` of this analysis, precision and device kind, when the caller kept it (training only;
    built here otherwise). ``data_parallel``: one device of a data-parallel training job, the model wrapped in
    ``DistributedDataParallel`` with PyTorch's defaults (``gradient_as_bucket_view=False``): its flat
    all-reduce buckets (:func:`ddp_bucket_sizes`, one allocation each) are a second copy of every gradient
    beside the ``.grad`` tensors, allocated when the model is wrapped and kept for the whole step
    (``ddp_gradient_buckets_bytes``, part of the peak whatever the instant). Raises ``KeyError`` for an
    unknown optimizer or precision and ``ValueError`` for an unknown mode, a batch below 1, ``data_parallel``
    in inference or a ``layout`` of another precision or device kind.
    """
    half = PRECISIONS[precision]
    _, states = OPTIMIZERS[optimizer]
    if mode not in ("training", "inference"):
        raise ValueError(f"mode must be 'training' or 'inference', not {mode!r}")
    if data_parallel and mode != "training":
        raise ValueError("data_parallel (DDP's gradient buckets) applies to mode 'training' only")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    scale = 1.0 if batch_size is None else batch_size / analysis.graph.batch_size
    runtime, gpu = device_key(hardware)
    graph = analysis.graph
    layers = graph.layers
    runtime_bytes = runtime.context_bytes + runtime.workspace_bytes
    if mode == "inference":
        weights, _ = _weights(layers)
        # under autocast, weights the graph stores in 16 bits are held as stored (a model held in fp16 takes 2
        # bytes per parameter; autocast casts a weight per forward only when its type differs, a transient copy);
        # otherwise the fp32 weights
        sixteen = set(AUTOCAST_DTYPES.values())
        stored = {w.name: (BYTES_PER_ELEMENT[w.dtype] if half and w.dtype in sixteen else 4)
                  for w in weights.values()}
        w_bytes = sum(runtime.rounded(w.numel * stored[w.name]) for w in weights.values())
        checkpoint = sum(w.numel * stored[w.name] for w in weights.values())
        working = 0
        for layer in layers:
            ts = (*layer.inputs, *layer.outputs)
            working = max(working, sum(int(t.numel * scale) * (half if half and _is_float(t) else
                                                               BYTES_PER_ELEMENT.get(t.dtype, 4)) for t in ts))
        return MemoryFootprint(w_bytes, 0, 0, working, 0, 0, runtime_bytes, precision, checkpoint_bytes=checkpoint)

    if layout is None:
        layout = memory_layout(analysis, precision=precision, hardware=hardware)
    elif layout.half != half or layout.gpu != gpu:
        raise ValueError("layout was built for another precision or device kind")
    if activation_checkpointing:
        fp = _walk_sets(layers, graph.outputs, layout, scale, runtime=runtime, states=states, precision=precision,
                        activation_checkpointing=True)
    else:
        if layout.walk is None:
            layout.walk = _compile_walk(layout, layers, graph.outputs)
        fp = layout.walk.footprint(scale, runtime=runtime, states=states, precision=precision)
    if not data_parallel:
        return fp
    if layout.ddp_buckets is None:
        layout.ddp_buckets = tuple(ddp_bucket_sizes(layers))
    return replace(fp, ddp_gradient_buckets_bytes=sum(runtime.rounded(b) for b in layout.ddp_buckets))


def ddp_bucket_sizes(layers: Sequence[Layer]) -> list[int]:
    """Bytes of each of ``DistributedDataParallel``'s gradient buckets over the weights of ``layers``, in the
    order it fills them: every weight once (a shared one too), its gradient fp32 (4 B/element, as the footprint
    keeps them), taken in the order backward completes the gradients (latest in the graph first, a layer's
    own in their order; a weight read by several layers is complete at its first reader's backward), a bucket
    closed as soon as it holds
    :data:`DDP_FIRST_BUCKET_BYTES` (the first) or :data:`DDP_BUCKET_CAP_BYTES` (every later one), the rest in
    a last one. This is torch's ``_compute_bucket_assignment_by_size`` with DDP's default limits, as the
    reducer rebuilds its buckets after the first iteration in the order the gradients arrived
    (``torch/csrc/distributed/c10d/reducer.cpp``; the first iteration runs with one bucket of every gradient:
    the same bytes before the allocator's rounding). Their sum is the gradients' bytes. Empty without weights.
    """
    first: dict[str, tuple[int, int]] = {}  # weight → (its first reader, elements)
    for i, layer in enumerate(layers):
        for w in layer.weights:
            first.setdefault(w.name, (i, w.numel))
    sizes: list[int] = []
    size = 0
    for name in sorted(first, key=lambda name: -first[name][0]):  # stable: a layer's weights keep their order
        size += 4 * first[name][1]
        if size >= (DDP_FIRST_BUCKET_BYTES if not sizes else DDP_BUCKET_CAP_BYTES):
            sizes.append(size)
            size = 0
    if size:
        sizes.append(size)
    return sizes


def _loss_logits(layers: Sequence[Layer], outputs: Sequence[Tensor]) -> Tensor | None:
    """The graph output whose cross-entropy keeps its own fp32 log-probabilities (and two output-sized gradients
    in its backward): :func:`app.core.analysis.loss_input`, or None when there is none or when the graph ends in
    its own ``Softmax``/``LogSoftmax`` (the loss is then NLL on that output, already counted as the graph's)."""
    x = loss_input(outputs)
    return None if x is None or loss_on_probabilities(layers, x) else x


def _walk_sets(layers: Sequence[Layer], outputs: Sequence[Tensor], layout: Layout, scale: float, *,
               runtime: DeviceRuntime, states: int, precision: str, activation_checkpointing: bool) -> MemoryFootprint:
    """The training footprint of ``layout`` (built from ``layers``/``outputs``) at ``scale`` on a device of
    ``runtime``, walked tensor set by tensor set: the definition, what checkpointing runs (its segments depend
    on the bytes) and what :class:`_Walk` replays in numpy."""
    gpu = layout.gpu
    weights, last_use = _weights(layers)
    w_bytes = sum(runtime.rounded(w.numel * 4) for w in weights.values())
    runtime_bytes = runtime.context_bytes + runtime.workspace_bytes
    plan = _sized(layout, scale, runtime)
    n = len(layers)
    saved, extra = (_checkpoint(plan, n) if activation_checkpointing else (plan.saved, plan.extra))
    out_keys = {k for k in plan.nbytes if k in {t.name for t in outputs}}
    copies = {k for s in saved for k in s if k.endswith("@16") and k.split("@")[0] in weights}
    # free after the backward of the earliest layer that saved it
    release: dict[str, int] = {}
    for i in range(n):
        for k in saved[i]:
            release.setdefault(k, i)
    live_saved = {k for k in release} | out_keys
    act_keys = live_saved - copies
    first_out = _loss_logits(layers, outputs)  # what the loss layer of the time reads (app.core.analysis.loss_layer)
    loss_bytes = runtime.rounded(int(4 * first_out.numel * scale)) if first_out is not None else 0  # log_softmax output
    act_bytes = sum(plan.nbytes[k] for k in act_keys) + sum(extra) + loss_bytes
    copy_bytes = sum(plan.nbytes[k] for k in copies)
    end_of_forward = act_bytes + copy_bytes

    # reverse walk
    producer = {k: i for i in range(n) for k in plan.produced[i]}
    release_at: dict[int, list[str]] = {}
    for k, i in release.items():
        release_at.setdefault(i, []).append(k)
    alive = end_of_forward
    grads = 0
    grad_live: set[str] = set(out_keys)  # the loss gradient w.r.t. the output
    grad_bytes = sum(plan.nbytes[k] for k in grad_live)
    peak = end_of_forward + 2 * loss_bytes  # the loss's backward: two fp32 output-sized gradients
    alive -= loss_bytes
    grads_at: dict[int, int] = {}
    for name, w in weights.items():
        grads_at[last_use[name]] = grads_at.get(last_use[name], 0) + runtime.rounded(w.numel * 4)
    for i in range(n - 1, -1, -1):
        grads += grads_at.get(i, 0)
        for k in plan.consumed[i]:
            if k in plan.needs_grad and k not in grad_live and k in producer:
                grad_live.add(k)
                grad_bytes += plan.nbytes.get(k, 0)
        peak = max(peak, alive + grads + grad_bytes + plan.transient[i])
        for k in plan.produced[i]:
            if k in grad_live:
                grad_live.discard(k)
                grad_bytes -= plan.nbytes.get(k, 0)
        for k in release_at.get(i, ()):
            alive -= plan.nbytes[k]
        alive -= extra[i]
    grads_total = sum(runtime.rounded(w.numel * 4) for w in weights.values())
    state_bytes = states * grads_total
    largest_param = max((runtime.rounded(w.numel * 4) for w in weights.values()), default=0)
    step_tmp = (grads_total if states >= 2 else 0) if gpu else (2 * largest_param if states else 0)
    peak = max(peak, grads_total + step_tmp)
    return MemoryFootprint(
        weights_bytes=w_bytes,
        gradients_bytes=grads_total,
        optimizer_state_bytes=state_bytes,
        activations_bytes=act_bytes,
        weight_copies_bytes=copy_bytes,
        backward_transient_bytes=peak - end_of_forward,
        runtime_bytes=runtime_bytes,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        checkpoint_bytes=(1 + states) * sum(w.numel * 4 for w in weights.values()),
    )


def _weights(layers: Sequence[Layer]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Each weight by name (first occurrence) and the index of the last layer that reads it (backward
    reaches a weight's gradient there)."""
    weights: dict[str, Tensor] = {}
    last_use: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for w in layer.weights:
            weights.setdefault(w.name, w)
            last_use[w.name] = i
    return weights, last_use


@dataclass(frozen=True, slots=True)
class _Sums:
    """Fixed sums over a vector of byte counts ``b`` as one gather, one cumulative sum and one gather:
    ``P = cumsum0(b[rows] * coef)[bounds]`` (``cumsum0``: the cumulative sum with a leading 0), int64, so
    every sum :class:`_Walk` reads is a difference of two entries of ``P`` (exact integers: no float, no
    order dependence). ``coef`` is ``None`` when every coefficient is 1."""

    rows: np.ndarray  # intp [G]
    coef: np.ndarray | None  # int64 [G]
    bounds: np.ndarray  # intp [Q], indices into cumsum0 (0..G)

    def of(self, b: np.ndarray) -> np.ndarray:
        """``P`` ``[Q]`` (int64) for byte counts ``b``."""
        v = b[self.rows]
        if self.coef is not None:
            v = v * self.coef
        cs = np.zeros(len(v) + 1, dtype=np.int64)
        np.cumsum(v, out=cs[1:])
        return cs[self.bounds]


@dataclass(frozen=True, slots=True)
class _Walk:
    """:func:`footprint`'s training walk without activation checkpointing, compiled once per :class:`Layout`
    into numpy: which tensor is saved, released, or in flight as a gradient at each layer depends on the
    names alone, so only the byte counts depend on the batch and the device's allocator. ``footprint``
    sizes the layout's byte counts (:data:`_Size` rows: ``amount`` elements or bytes, ``per`` bytes per
    element, 1 for a buffer) and reads every sum of the reverse walk from one cumulative sum over them
    (:class:`_Sums`): the same integers as the set-by-set walk :func:`_walk_sets`
    (``tests/predictions/test_fresh_identical.py``). The rows that do not scale with the batch (weights and
    fixed buffers) are sized and summed once per device runtime (``per_runtime``), so a call sizes and sums
    the batch-scaled rows only.

    The sums ``P`` (``[n + 2 T + 8]``, of the scaled rows plus those of the fixed rows), at step ``j`` of the
    reverse walk (layer ``n - 1 - j``): ``P[j]`` = the gradients in flight added up to step ``j``, minus those
    done and the saved tensors (and extra bytes) released before step ``j``; then per layer with transient
    bytes (``transient_step``) the end and the start of its terms; then the ends and starts of the saved
    activations alive at the end of forward (and the output), of autocast's weight copies among them, of the
    model output's keys (their gradient is the first in flight) and of the layers' extra terms."""

    amount: np.ndarray  # float64 [Ss]: elements (or bytes) of each batch-scaled row at the graph's batch
    per: np.ndarray  # int64 [Ss]: bytes per element (1 for a buffer)
    fixed_bytes: np.ndarray  # int64 [Sf]: bytes of each fixed row before allocator rounding
    scaled_sums: _Sums  # over the scaled rows' bytes
    fixed_sums: _Sums  # over the fixed rows' bytes (the same layout of P)
    extra_fixed: np.ndarray  # int64 [n]: extras that are plain integers
    extra_fixed_total: int  # their sum
    extra_fixed_before: np.ndarray  # int64 [n]: at step j, the plain extras of the layers released before it
    transient_step: np.ndarray  # intp [T]: the step of each layer with transient terms
    loss_numel: int | None  # elements of the first float output (the loss's log_softmax), None without one
    weight_numel: np.ndarray  # int64 [W]: elements of each weight
    weight_last_use: np.ndarray  # intp [W]: the layer whose backward reaches its gradient
    weight_elements: int  # their sum
    gpu: bool
    nonnegative: bool  # every amount and per is >= 0 (the rounding's sign test can be skipped)
    per_runtime: dict[DeviceRuntime, tuple[int, int, np.ndarray, np.ndarray]]  # see _runtime_terms

    def _runtime_terms(self, runtime: DeviceRuntime) -> tuple[int, int, np.ndarray, np.ndarray]:
        """What a device of ``runtime`` holds whatever the batch: all gradients' bytes, the largest one's, the
        gradients alive at each step of the reverse walk less the plain extras released before it ``[n]``, and
        the fixed rows' sums ``P`` (kept per runtime)."""
        found = self.per_runtime.get(runtime)
        if found is None:
            param = _rounded(self.weight_numel * 4, runtime)
            grads_at = np.zeros(len(self.extra_fixed), dtype=np.int64)
            np.add.at(grads_at, self.weight_last_use, param)
            alive = np.cumsum(grads_at[::-1]) - self.extra_fixed_before
            fixed = self.fixed_sums.of(_rounded(self.fixed_bytes, runtime))
            found = self.per_runtime.setdefault(
                runtime, (int(param.sum()), int(param.max()) if len(param) else 0, alive, fixed))
        return found

    def footprint(self, scale: float, *, runtime: DeviceRuntime, states: int, precision: str) -> MemoryFootprint:
        """The training :class:`MemoryFootprint` at ``scale`` (batch / the graph's batch) on a device of
        ``runtime`` with ``states`` optimizer states per parameter."""
        n = len(self.extra_fixed)
        grads, largest, alive, fixed = self._runtime_terms(runtime)
        b = np.trunc(self.amount * scale).astype(np.int64) * self.per
        p = self.scaled_sums.of(_rounded(b, runtime) if not self.nonnegative else _rounded_nonnegative(b, runtime))
        p += fixed
        t = len(self.transient_step)
        act_end, act_start, copy_end, copy_start, out_end, out_start, ex_end, ex_start = p[n + 2 * t:].tolist()
        loss = runtime.rounded(int(4 * self.loss_numel * scale)) if self.loss_numel is not None else 0
        act = (act_end - act_start) + (ex_end - ex_start) + self.extra_fixed_total + loss
        copies = copy_end - copy_start
        end_of_forward = act + copies
        peak = end_of_forward + 2 * loss
        if n:
            live = p[:n] + alive
            if t:
                live[self.transient_step] += np.minimum(p[n:n + t] - p[n + t:n + 2 * t], 1024 * MIB)
            # at each step: what is alive of the end of forward (the loss's output gone), the weights' gradients
            # reached, the activation gradients in flight and the layer's transient
            peak = max(peak, int(live.max()) + (end_of_forward - loss) + (out_end - out_start))
        step_tmp = (grads if states >= 2 else 0) if self.gpu else (2 * largest if states else 0)
        peak = max(peak, grads + step_tmp)
        return MemoryFootprint(
            weights_bytes=grads, gradients_bytes=grads, optimizer_state_bytes=states * grads,
            activations_bytes=act, weight_copies_bytes=copies, backward_transient_bytes=peak - end_of_forward,
            runtime_bytes=runtime.context_bytes + runtime.workspace_bytes, precision=precision,
            activation_checkpointing=False, checkpoint_bytes=(1 + states) * self.weight_elements * 4,
        )  # fmt: skip


def _rounded(nbytes: np.ndarray, runtime: DeviceRuntime) -> np.ndarray:
    """:meth:`DeviceRuntime.rounded` of every element of ``nbytes`` (int64)."""
    if runtime.block_bytes <= 1:
        return nbytes
    return np.where(nbytes > 0, _rounded_nonnegative(nbytes, runtime), nbytes)


def _rounded_nonnegative(nbytes: np.ndarray, runtime: DeviceRuntime) -> np.ndarray:
    """:func:`_rounded` of ``nbytes`` (int64) whose elements are all >= 0 (0 stays 0: ``ceil(0 / block)``)."""
    bb, lb = runtime.block_bytes, runtime.large_block_bytes
    if bb <= 1:
        return nbytes
    r = _ceil_to(nbytes, bb)
    large = r >= runtime.large_from_bytes
    if large.any():
        r = np.where(large, _ceil_to(r, lb), r)
    return r


def _ceil_to(x: np.ndarray, block: int) -> np.ndarray:
    """Each element of ``x`` (int64) rounded up to a multiple of ``block`` (>= 1): ``ceil(x / block) * block``,
    with a mask when ``block`` is a power of two (the allocator's are)."""
    if block & (block - 1) == 0:
        return (x + (block - 1)) & -block
    return (x + (block - 1)) // block * block


def _compile_walk(layout: Layout, layers: Sequence[Layer], outputs: Sequence[Tensor]) -> _Walk:
    """The :class:`_Walk` of ``layout`` (built from ``layers``/``outputs``): the set logic of
    :func:`_walk_sets` run once on names, its byte counts left as size rows."""
    n = len(layers)
    keys = {k: j for j, k in enumerate(layout.sizes)}
    rows: list[_Size] = list(layout.sizes.values())

    def row(size: _Size) -> int:
        rows.append(size)
        return len(rows) - 1

    extra_fixed = np.zeros(n, dtype=np.int64)
    extra_terms: list[tuple[int, int, int]] = []  # (layer, coefficient, row)
    for i, e in enumerate(layout.extra):
        if isinstance(e, _Terms):
            extra_terms += [(i, c, row(size)) for c, size in e.terms]
        else:
            extra_fixed[i] = e
    transient: dict[int, list[int]] = {}  # layer -> its terms' rows
    for i, t in enumerate(layout.transient):
        for size in t or ():
            transient.setdefault(i, []).append(row(size))
    saved = layout.saved
    out_names = {t.name for t in outputs}
    out_keys = {k for k in layout.sizes if k in out_names}
    weights, last_use = _weights(layers)
    copies = {k for s in saved for k in s if k.endswith("@16") and k.split("@")[0] in weights}
    release: dict[str, int] = {}
    for i in range(n):
        for k in saved[i]:
            release.setdefault(k, i)
    act_keys = ({k for k in release} | out_keys) - copies
    first_out = _loss_logits(layers, outputs)
    # the gradients in flight, replayed on names (the reverse walk of _walk_sets without the bytes)
    producer = {k: i for i in range(n) for k in layout.produced[i]}
    grad_live = set(out_keys)
    add: list[tuple[int, int]] = []
    done: list[tuple[int, int]] = []
    for i in range(n - 1, -1, -1):
        for k in layout.consumed[i]:
            if k in layout.needs_grad and k not in grad_live and k in producer:
                grad_live.add(k)
                if k in keys:
                    add.append((i, keys[k]))
        for k in layout.produced[i]:
            if k in grad_live:
                grad_live.discard(k)
                if k in keys:
                    done.append((i, keys[k]))

    # the terms of P (see _Walk) as (step from which they count, row, coefficient) for the running sum, then
    # the segments summed whole; step j of the reverse walk is layer n - 1 - j
    running = ([(n - 1 - i, r, 1) for i, r in add] + [(n - i, r, -1) for i, r in done]
               + [(n - i, keys[k], -1) for k, i in release.items()] + [(n - i, r, -c) for i, c, r in extra_terms])
    transient_layers = sorted(transient)
    segments = ([[(r, 1) for r in transient[i]] for i in transient_layers]
                + [[(keys[k], 1) for k in sorted(ks, key=keys.__getitem__)] for ks in (act_keys, copies, out_keys)]
                + [[(r, c) for _, c, r in extra_terms]])
    scaled = np.asarray([not (r[3] if r[0] == "t" else not r[3]) for r in rows], dtype=bool).reshape(len(rows))
    position = np.zeros(len(rows), dtype=np.intp)  # each row's index among the scaled or among the fixed rows
    position[scaled] = np.arange(int(scaled.sum()))
    position[~scaled] = np.arange(int((~scaled).sum()))

    def sums(keep: bool) -> _Sums:
        """The :class:`_Sums` of the terms over the scaled (``keep``) or the fixed rows."""
        mine = sorted(((s, int(position[r]), c) for s, r, c in running if scaled[r] == keep), key=lambda x: x[0])
        steps = np.asarray([s for s, _, _ in mine], dtype=np.intp)
        g_rows = [r for _, r, _ in mine]
        g_coef = [c for _, _, c in mine]
        bounds = list(np.searchsorted(steps, np.arange(n), side="right").tolist())
        ends, starts = [], []
        for seg in segments:
            starts.append(len(g_rows))
            for r, c in seg:
                if scaled[r] == keep:
                    g_rows.append(int(position[r]))
                    g_coef.append(c)
            ends.append(len(g_rows))
        t = len(transient_layers)
        bounds += ends[:t] + starts[:t]
        for e, s in zip(ends[t:], starts[t:], strict=True):
            bounds += [e, s]
        coef = np.asarray(g_coef, dtype=np.int64)
        return _Sums(rows=np.asarray(g_rows, dtype=np.intp), coef=None if (coef == 1).all() else coef,
                     bounds=np.asarray(bounds, dtype=np.intp))

    amount = np.asarray([float(r[1]) for r in rows], dtype=np.float64)
    per = np.asarray([r[2] if r[0] == "t" else 1 for r in rows], dtype=np.int64)
    released_plain = np.zeros(n + 1, dtype=np.int64)  # at step j: the plain extras of the steps before it
    released_plain[1:] = np.cumsum(extra_fixed[::-1])
    return _Walk(
        amount=amount[scaled], per=per[scaled],
        fixed_bytes=np.trunc(amount[~scaled]).astype(np.int64) * per[~scaled],
        scaled_sums=sums(True), fixed_sums=sums(False), extra_fixed=extra_fixed,
        extra_fixed_total=int(extra_fixed.sum()),
        extra_fixed_before=released_plain[:n],
        transient_step=np.asarray([n - 1 - i for i in transient_layers], dtype=np.intp),
        loss_numel=first_out.numel if first_out is not None else None,
        weight_numel=np.asarray([w.numel for w in weights.values()], dtype=np.int64),
        weight_last_use=np.asarray([last_use[name] for name in weights], dtype=np.intp),
        weight_elements=sum(w.numel for w in weights.values()), gpu=layout.gpu,
        nonnegative=bool((amount >= 0).all() and (per >= 0).all()), per_runtime={},
    )  # fmt: skip


def fits(fp: MemoryFootprint, memory_bytes: float) -> bool:
    """Whether the predicted peak ``fp.total_bytes`` fits in :data:`HEADROOM` of ``memory_bytes``."""
    return fp.total_bytes <= HEADROOM * memory_bytes


def largest_batch_that_fits(
    analysis: GraphAnalysis,
    *,
    memory_bytes: float,
    mode: str,
    optimizer: str,
    precision: str = "fp32",
    hardware: HardwareSpec | None = None,
    activation_checkpointing: bool = False,
    max_batch: int = 1 << 20,
    footprint_at: Callable[[int], MemoryFootprint] | None = None,
    layout: Layout | None = None,
    data_parallel: bool = False,
) -> int:
    """Largest batch size whose predicted peak fits in ``memory_bytes`` (:func:`fits`); 0 if none does.

    The peak is monotone in the batch and almost affine in it: model state, gradients and runtime are
    constant, every activation tensor scales linearly, but allocator block rounding, integer truncation,
    the ``max`` over the backward walk's steps (and the optimizer step), the inference working set's
    ``max`` over layers and the checkpoint segment boundaries make it piecewise affine. So the search
    jumps along the secant through the two latest points inside a bracket ``fits(lo)``, ``not fits(hi)``
    (``lo`` 0 until a batch fits), and stops when ``hi == lo + 1``: the answer is verified by exact
    evaluations at it and at its successor (at 1 when nothing fits). The first point is the footprint at
    the graph's own batch (a prediction has it already); the one before it is not evaluated but the line
    through it and the batch-independent bytes at batch 0 (:attr:`MemoryFootprint.model_state_bytes`: what
    does not scale), so the first jump lands within a few batches of the answer on real graphs and the
    next secant, through two exact points on the answer's piece, on it: 2-4 evaluations besides the
    graph's batch (a bisection takes 14-30). Capped at ``max_batch`` (returned when it fits).
    ``footprint_at``: the footprint at a batch, ``footprint(..., batch_size=b)`` of these options (the
    default), for a caller that memoises it; ``layout`` and ``data_parallel`` (the batch is then per device)
    as for :func:`footprint` (the layout built once here otherwise). Raises like :func:`footprint`.
    """
    limit = HEADROOM * memory_bytes
    if layout is None and footprint_at is None and mode == "training":
        layout = memory_layout(analysis, precision=precision, hardware=hardware)

    def exact(b: int) -> MemoryFootprint:
        return footprint(analysis, mode=mode, optimizer=optimizer, precision=precision, hardware=hardware,
                         activation_checkpointing=activation_checkpointing, batch_size=b,
                         layout=layout, data_parallel=data_parallel)

    at = footprint_at or exact
    lo, hi = 0, max_batch + 1  # fits(lo) (0: nothing verified yet); hi does not fit or lies beyond the cap
    ends: list[int | None] = [None, None]  # the exact peaks at lo and at hi, once evaluated
    b = min(max_batch, max(1, analysis.graph.batch_size))
    last: tuple[int, int] | None = None
    stalled = 0
    while hi - lo > 1:
        if b <= lo or b >= hi:
            b = (lo + hi) // 2
        fp = at(b)
        t = fp.total_bytes
        if last is None:  # the graph's batch: the line from what does not scale with the batch (at batch 0)
            last = (0, min(fp.model_state_bytes, t))
        width = hi - lo
        if t <= limit:
            lo, ends[0] = b, t
        else:
            hi, ends[1] = b, t
        stalled = stalled + 1 if 2 * (hi - lo) > width else 0
        t_lo, t_hi = ends
        # the secant through the bracket's ends once both are exact (two close points of the latest steps can
        # straddle a rounding step and throw the secant far off), else through the latest two points
        (xa, ta), (xb, tb) = ((lo, t_lo), (hi, t_hi)) if t_lo is not None and t_hi is not None else (last, (b, t))
        last = (b, t)
        if stalled >= 3:  # a curved stretch: halve the bracket once, then follow the secants again
            b, stalled = (lo + hi) // 2, 0
        elif tb != ta and xb != xa:
            b = xb + math.floor((limit - tb) * (xb - xa) / (tb - ta))  # last batch under the secant
            b = min(max(b, lo + 1), hi - 1)  # inside the bracket: at the answer, its successor is tested
        else:  # flat (or a repeated point): no slope to follow
            b = (lo + hi) // 2
    return lo
