"""Roofline fallback predictor: datasheet peaks, a per-layer overhead floor and an efficiency factor.

For a pass with ``F`` FLOPs and ``B`` bytes on a device with peak ``P`` FLOP/s and bandwidth ``W`` B/s,

    time_ms = max(F / P, B / W) · 1e3 / efficiency + floor_ms(pass)

``max(F/P, B/W)`` is the roofline bound (Williams et al. 2009, :mod:`app.core.roofline`);
``efficiency`` is the achieved fraction of the roof for layers large enough that the floor does not
matter; ``floor_ms`` is the per-layer overhead floor (kernel launch, framework dispatch, session
overhead; DESIGN.md), one value for a forward pass and one for a whole training step. The constants are
fitted on the Justus et al. 2018 training rows by :func:`fit_roofline_constants` and stored in the model
metadata (``metadata["roofline"]``); :data:`DEFAULT_CONSTANTS` is used only without metadata.

Training steps: total = roofline of forward + backward + optimizer update (``optimizer_update_cost``)
with the train-step floor; forward = forward roofline with the forward floor; update = the update's
roofline time / efficiency; backward = the rest (:func:`app.predictor.base.split_training_step`, never
less than the backward pass's own roofline time).

Streaming (non-MAC) ops — norms, activations, elementwise, pooling, softmax, data movement, embedding —
are separate, memory-bound kernels that the Justus data never measured in isolation; they use
``time = max(F / P, B / (W · STREAM_EFFICIENCY)) + KERNEL_FLOOR_MS`` per kernel (one forward kernel, and
one more for backward in training). Metadata-only views (Reshape/Flatten/Squeeze: 0 FLOPs, 0 bytes)
take no time, and so does an inference (eval-mode) dropout, the identity. Applying the conv/dense
efficiency and TF1 session floor to them would overstate a ResNet-50 step by ~2× (they are ~70 % of its
layers). A fused attention layer (:mod:`app.core.fusion`) is costed the same way at the attention
roofline: its FLOPs at :data:`ATTENTION_EFFICIENCY` of the peak it may use (tensor cores), Q, K, V
and the output moved once, not two batched GEMMs at the conv/dense efficiency.

Precision (:mod:`app.core.precision`): each op uses the peak it may use under the request's precision
(tensor-core rates for MAC-class ops under tf32/fp16/bf16 and for cuDNN ops under fp32 on Ampere and
newer, the fp32 vector rate for streaming ops) and moves its bytes at the precision's storage type
(2-byte activations and weight copies under fp16/bf16 autocast, so mixed precision speeds up memory-bound
ops too); the optimizer update streams fp32 master weights, gradients and state.

Software stack (``query.software_stack``, :class:`app.core.vocab.SoftwareStack`): the fixed cost per
kernel launch differs between stacks (:data:`KERNEL_FLOOR_MS_BY_STACK`). Under ``tf1-session`` a MAC-class
layer keeps the per-layer floors fitted on the Justus data (one ``Session.run`` per timed layer); under
every other stack a layer pays the stack's per-kernel floor for each kernel it launches: one forward, one
or two backward (input and weight gradients), and its share of the foreach optimizer step's launches
(:func:`app.core.fusion.update_kernel_launches`). Streaming ops pay one per-kernel floor per pass.

Intervals: ``p10 = total · interval_low``, ``p90 = total · interval_high``, the 10th and 90th
percentiles of measured / predicted time on held-out Justus rows (so the 80 % interval is calibrated
for conv/dense layers on the five Justus GPUs and only indicative elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from app.core.costs import LayerCost, optimizer_update_cost
from app.core.features import HALF_PRECISIONS
from app.core.fusion import update_kernel_launches
from app.core.hardware import HardwareSpec
from app.core.ir import OpKind
from app.core.precision import (
    AUTOCAST_FP32_CAST_BYTES,
    UPDATE_BYTES_PER_PARAM,
    autocast_cast_bytes,
    cost_at_precision,
    op_precision,
)
from app.core.roofline import roofline_time_s
from app.core.vocab import SoftwareStack
from app.predictor.base import LayerTimeEstimate, LayerTimeQuery, split_training_step


@dataclass(frozen=True, slots=True)
class RooflineConstants:
    """Fitted constants of the roofline predictor (see module docstring); ``source`` says where from."""

    efficiency: float
    floor_forward_ms: float
    floor_train_step_ms: float
    interval_low: float
    interval_high: float
    source: str = "default"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping of the fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RooflineConstants:
        """Inverse of :meth:`to_dict`; raises ``KeyError`` for a missing field."""
        return cls(
            efficiency=float(data["efficiency"]),
            floor_forward_ms=float(data["floor_forward_ms"]),
            floor_train_step_ms=float(data["floor_train_step_ms"]),
            interval_low=float(data["interval_low"]),
            interval_high=float(data["interval_high"]),
            source=str(data.get("source", "metadata")),
        )


# Achievable fraction of datasheet bandwidth for streaming kernels: ~0.8-0.9 on NVIDIA GPUs (Jia et al. 2018,
# "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking": 750 of 900 GB/s on V100) and on CPUs
# for STREAM triad. 0.8 is the conservative end.
STREAM_EFFICIENCY = 0.8
# Fixed cost of one kernel inside a running network, ms, per software stack. Estimates, not fitted (h-model
# fits per-stack floors from data inside the learned model):
# - pytorch-eager: Python, autograd recording, ATen dispatch and cudaLaunchKernel add ~5-25 µs of host work
#   per op ("From PyTorch op to kernel launch", jiahuanglin.xyz GPU-kernel-serving lesson 18; Jia et al. 2018
#   measure ~5 µs for the launch alone); 10 µs.
# - pytorch-cuda-graph: a graph replay removes the host work; ~2-4 µs of back-to-back kernel gaps remain
#   (PyTorch blog "Accelerating PyTorch with CUDA Graphs", 2021, qualitative); 3 µs.
# - pytorch-compiled: Inductor's generated wrapper launches fused Triton/library kernels without ATen
#   dispatch; 5 µs (estimate).
# - cuda-library: a bare library call from C++ (DeepBench), launch only; 5 µs (Jia et al. 2018).
# - tf1-session: per-op executor overhead inside a TF1 graph ~10 µs (estimate); MAC-class layers use the
#   per-layer floors fitted on Justus (RooflineConstants) instead.
KERNEL_FLOOR_MS_BY_STACK: Mapping[SoftwareStack, float] = {
    SoftwareStack.PYTORCH_EAGER: 0.010,
    SoftwareStack.PYTORCH_CUDA_GRAPH: 0.003,
    SoftwareStack.PYTORCH_COMPILED: 0.005,
    SoftwareStack.CUDA_LIBRARY: 0.005,
    SoftwareStack.TF1_SESSION: 0.010,
}
KERNEL_FLOOR_MS = KERNEL_FLOOR_MS_BY_STACK[SoftwareStack.PYTORCH_EAGER]
# Achieved fraction of the tensor-core peak of a fused attention kernel: FlashAttention-2 reaches 50-73 % of
# the A100's peak forward and somewhat less backward (Dao 2023, "FlashAttention-2: Faster Attention with
# Better Parallelism and Work Partitioning", abstract and Sec. 4); 0.6 for both passes. Not fitted.
ATTENTION_EFFICIENCY = 0.6
# Interval of streaming ops: not calibrated (no measurements), a ×2 band either side.
STREAM_INTERVAL = (0.5, 2.0)
_MAC_KINDS = frozenset({OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.GEMM, OpKind.MATMUL, OpKind.RECURRENT})

# Used only when no metadata is available: efficiency 0.5 and floors of 0.1 / 0.3 ms are mid-range
# values of the Justus data (DESIGN.md: floor ≈ 0.1-0.5 ms); a ×3 interval either side.
DEFAULT_CONSTANTS = RooflineConstants(0.5, 0.1, 0.3, 1 / 3, 3.0, "default (DESIGN.md ranges, not fitted)")


def fit_roofline_constants(
    *,
    roofline_ms: np.ndarray,
    time_ms: np.ndarray,
    is_train: np.ndarray,
    calib_roofline_ms: np.ndarray,
    calib_time_ms: np.ndarray,
    calib_is_train: np.ndarray,
    source: str,
) -> RooflineConstants:
    """Fit :class:`RooflineConstants` on measured rows (all arrays ``[N]``, times in ms).

    * floors: per pass, the median measured time of the 5 % of rows with the smallest roofline time;
    * efficiency: median of ``roofline / (time − floor)`` over the rows whose roofline time is at least
      10× their floor (large layers, where the floor is negligible);
    * interval: 10th/90th percentile of ``time / predicted`` on the calibration rows (held out).

    Raises ``ValueError`` when a pass has no rows.
    """
    roofline_ms = np.asarray(roofline_ms, dtype=np.float64)
    time_ms = np.asarray(time_ms, dtype=np.float64)
    is_train = np.asarray(is_train, dtype=bool)
    floors = []
    for sel in (~is_train, is_train):
        if not sel.any():
            raise ValueError("fit_roofline_constants needs forward and train_step rows")
        r, t = roofline_ms[sel], time_ms[sel]
        small = r <= np.quantile(r, 0.05)
        floors.append(float(np.median(t[small])))
    floor = np.where(is_train, floors[1], floors[0])
    big = (roofline_ms >= 10 * floor) & (time_ms > floor)
    if big.sum() < 10:
        big = time_ms > floor
    eff = float(np.median(roofline_ms[big] / (time_ms[big] - floor[big])))
    eff = min(max(eff, 1e-3), 1.0)
    c_floor = np.where(np.asarray(calib_is_train, dtype=bool), floors[1], floors[0])
    pred = np.asarray(calib_roofline_ms, dtype=np.float64) / eff + c_floor
    ratio = np.asarray(calib_time_ms, dtype=np.float64) / pred
    lo, hi = np.quantile(ratio, [0.1, 0.9])
    return RooflineConstants(eff, floors[0], floors[1], float(min(lo, 1.0)), float(max(hi, 1.0)), source)



#: DRAM bytes per parameter of autocast's weight cast of an fp32 weight (``aten::_to_copy`` fp32 -> fp16/bf16):
#: 4 read, 2 written (:func:`app.core.precision.autocast_cast_bytes` counts every stored type).
AUTOCAST_CAST_BYTES_PER_PARAM = AUTOCAST_FP32_CAST_BYTES


def autocast_weight_cast_ms(cast_bytes: Any, *, precision: str, hardware: HardwareSpec, stack: SoftwareStack,
                            kernel_ms: float) -> np.ndarray:
    """Autocast's weight casts (ms, same shape as ``cast_bytes``; 0 where none): under fp16/bf16 ``torch.autocast``
    on a GPU a conv/GEMM/matmul/recurrent layer's weights are cast to 16 bits once per forward (autocast's weight
    cache lives for one autocast region, one iteration; the backward reads the cached copy): one element-wise
    kernel moving ``cast_bytes`` (:func:`app.core.precision.autocast_cast_bytes`: 6 per fp32 parameter, none for
    a weight already in autocast's type) at :data:`STREAM_EFFICIENCY` of the DRAM bandwidth plus one launch at
    ``kernel_ms``. The training footprint holds the same copies (:mod:`app.core.memory`). All 0 on CPUs, at other
    precisions and under ``tf1-session`` (no autocast). Not counted: casts of activations between autocast's fp16
    and fp32 op lists. Raises ``ValueError`` for a negative byte count."""
    n = np.asarray(cast_bytes, dtype=np.float64)
    if n.size and float(n.min()) < 0:
        raise ValueError("cast byte counts must be >= 0")
    if hardware.kind != "gpu" or precision not in HALF_PRECISIONS or stack is SoftwareStack.TF1_SESSION:
        return np.zeros_like(n)
    bw = float(hardware.memory_bandwidth_bytes_per_s) * STREAM_EFFICIENCY
    return np.where(n > 0, n / bw * 1e3 + kernel_ms, 0.0)


def streaming_update_ms(q: LayerTimeQuery) -> float:
    """The optimizer step over ``q``'s parameters (ms) as PyTorch's foreach optimizers run it: a streaming
    kernel over the fp32 master weights, gradients and state (``max(F / P, B / (W · STREAM_EFFICIENCY))`` at
    the fp32 vector peak ``P``) plus the layer's share of the step's launches
    (:func:`app.core.fusion.update_kernel_launches`) at the stack's per-kernel floor. 0 without parameters or
    in inference. Raises ``KeyError`` for an unknown optimizer or a device without an fp32 peak."""
    if q.mode != "training" or not q.cost.params:
        return 0.0
    flops, nbytes = optimizer_update_cost(q.cost.params, q.optimizer, bytes_per_param=UPDATE_BYTES_PER_PARAM)
    if flops == 0 and nbytes == 0:
        return 0.0
    peak = op_precision(q.hardware, q.precision, OpKind.ELEMENTWISE).peak_flops_per_s
    bw = float(q.hardware.memory_bandwidth_bytes_per_s) * STREAM_EFFICIENCY
    launches = update_kernel_launches(len(q.layer.weights), q.optimizer)
    return max(flops / peak, nbytes / bw) * 1e3 + KERNEL_FLOOR_MS_BY_STACK[SoftwareStack(q.software_stack)] * launches


class RooflinePredictor:
    """Fallback :class:`~app.predictor.base.Predictor` for every supported op kind and any device.

    Raises ``ValueError`` for a query whose ``cost.supported`` is False (callers list unsupported ops
    separately and never pass them), an unknown mode, or a device without an fp32 peak.
    ``out_of_distribution`` is True on CPU devices (the constants were fitted on GPUs only).
    """

    def __init__(self, constants: RooflineConstants = DEFAULT_CONSTANTS, *, version: str = "roofline") -> None:
        self.constants = constants
        self.version = version

    def _one(self, q: LayerTimeQuery, at_precision: LayerCost | None = None) -> LayerTimeEstimate:
        if not q.cost.supported:
            raise ValueError(f"layer {q.cost.name!r} ({q.cost.op_type}) is unsupported; list it, do not estimate it")
        hw = q.hardware
        try:
            peak = op_precision(hw, q.precision, q.layer.kind).peak_flops_per_s
            vector_peak = op_precision(hw, q.precision, OpKind.ELEMENTWISE).peak_flops_per_s
        except KeyError as exc:
            raise ValueError(f"hardware {hw.id!r} lists no fp32 peak") from exc
        c = cost_at_precision(q.layer, q.cost, q.precision) if at_precision is None else at_precision
        bw = float(hw.memory_bandwidth_bytes_per_s)
        k = self.constants

        def roof_ms(flops: float, nbytes: float, rate: float = peak) -> float:
            return roofline_time_s(flops, nbytes, peak_flops_per_s=rate, bandwidth_bytes_per_s=bw) * 1e3

        ood = hw.kind != "gpu"
        if c.kind is OpKind.DROPOUT and q.mode == "inference":
            # nn.Dropout in eval mode returns its input (a view): no kernel runs, 0 ms (physics floor 0 too)
            return LayerTimeEstimate(
                forward_ms=0.0, backward_ms=0.0, update_ms=0.0, total_ms_p10=0.0, total_ms_p90=0.0,
                method="roofline", out_of_distribution=ood,
                notes=("dropout in inference (eval) mode is the identity: returns its input as a view, 0 ms",),
            )
        if c.kind not in _MAC_KINDS:
            return self._streaming(q, c, peak, bw, ood)
        stack = SoftwareStack(q.software_stack)
        kernel_ms = KERNEL_FLOOR_MS_BY_STACK[stack]
        tf1 = stack is SoftwareStack.TF1_SESSION
        if tf1:
            notes = [f"roofline/efficiency {k.efficiency:.3g} + per-layer tf1-session floor ({k.source})"]
        else:
            notes = [f"roofline/efficiency {k.efficiency:.3g} ({k.source}) + {stack.value} floor of "
                     f"{kernel_ms * 1e3:.0f} us per kernel"]
        if ood:
            notes.append("floor and efficiency were fitted on GPUs; CPU estimate is indicative only")
        n_cast = autocast_cast_bytes(q.layer, str(q.precision), training=q.mode == "training")
        cast = float(autocast_weight_cast_ms(n_cast, precision=str(q.precision), hardware=hw, stack=stack,
                                             kernel_ms=kernel_ms))  # fmt: skip
        if cast:
            notes.append(f"+ autocast weight cast ({cast * 1e3:.1f} us: {n_cast} bytes moved to 16 bits, one kernel)")
        fwd = roof_ms(c.forward_flops, c.forward_bytes) / k.efficiency + (k.floor_forward_ms if tf1 else kernel_ms)
        fwd += cast
        if q.mode == "inference":
            total, f, b, u = fwd, fwd, 0.0, 0.0
        elif q.mode == "training":
            upd_flops, upd_bytes = optimizer_update_cost(c.params, q.optimizer, bytes_per_param=UPDATE_BYTES_PER_PARAM)
            upd = roof_ms(upd_flops, upd_bytes, vector_peak) / k.efficiency
            fb = roof_ms(c.forward_flops + c.backward_flops, c.forward_bytes + c.backward_bytes) / k.efficiency
            if tf1:
                total = fb + upd + k.floor_train_step_ms
            else:  # one forward kernel, one per backward product, the layer's share of the foreach launches
                n_bwd = int(c.backward_input_flops > 0) + int(c.backward_weight_flops > 0)
                upd += kernel_ms * update_kernel_launches(len(q.layer.weights), q.optimizer)
                total = fb + upd + kernel_ms * (1 + n_bwd) + cast
            bwd_min = roof_ms(c.backward_flops, c.backward_bytes) if c.backward_flops or c.backward_bytes else 0.0
            f, b, u = split_training_step(total_ms=total, forward_ms=fwd, update_ms=upd, backward_min_ms=bwd_min)
        else:
            raise ValueError(f"mode must be 'training' or 'inference', got {q.mode!r}")
        return LayerTimeEstimate(
            forward_ms=f,
            backward_ms=b,
            update_ms=u,
            total_ms_p10=total * k.interval_low,
            total_ms_p90=total * k.interval_high,
            method="roofline",
            out_of_distribution=ood,
            notes=tuple(notes),
        )

    def _streaming(self, q: LayerTimeQuery, c: LayerCost, peak: float, bw: float, ood: bool) -> LayerTimeEstimate:
        """Kernel model for non-MAC ops and fused attention (see module docstring); ``c`` is the cost at the
        query's precision, ``peak`` the rate the op may use (fp32 vector rate; tensor-core rate for attention,
        of which it reaches :data:`ATTENTION_EFFICIENCY`)."""

        stack = SoftwareStack(q.software_stack)
        kernel_ms = KERNEL_FLOOR_MS_BY_STACK[stack]

        rate = peak * (ATTENTION_EFFICIENCY if c.kind is OpKind.ATTENTION else 1.0)

        def t_ms(flops: float, nbytes: float, kernels: float = 1.0) -> float:
            if flops == 0 and nbytes == 0:
                return 0.0  # metadata-only view: no kernel runs
            return max(flops / rate, nbytes / (bw * STREAM_EFFICIENCY)) * 1e3 + kernel_ms * kernels

        fwd = t_ms(c.forward_flops, c.forward_bytes)
        bwd = upd = 0.0
        if q.mode == "training":
            bwd = t_ms(c.backward_flops, c.backward_bytes)
            upd = streaming_update_ms(q)
        elif q.mode != "inference":
            raise ValueError(f"mode must be 'training' or 'inference', got {q.mode!r}")
        total = fwd + bwd + upd
        lo, hi = STREAM_INTERVAL
        return LayerTimeEstimate(
            forward_ms=fwd,
            backward_ms=bwd,
            update_ms=upd,
            total_ms_p10=total * lo,
            total_ms_p90=total * hi,
            method="roofline",
            out_of_distribution=ood,
            notes=(f"streaming kernel: bytes / ({STREAM_EFFICIENCY:.0%} of bandwidth) + {stack.value} floor of "
                   f"{kernel_ms * 1e3:.0f} us per kernel",),
        )

    def estimate(
        self, queries: Sequence[LayerTimeQuery], *, at_precision: Sequence[LayerCost] | None = None
    ) -> list[LayerTimeEstimate]:
        """One estimate per query, in order (see class docstring for errors). ``at_precision``: each query's
        cost at its precision (:func:`app.core.precision.cost_at_precision` of its layer and cost) when the
        caller has them already (a table's :meth:`app.predictor.table.LayerTable.rescaled` costs)."""
        if at_precision is None:
            return [self._one(q) for q in queries]
        return [self._one(q, c) for q, c in zip(queries, at_precision, strict=True)]
