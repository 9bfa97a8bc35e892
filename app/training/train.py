"""Train the learned per-layer runtime predictor v4: efficiency over the physics floor, GPU and CPU heads.

``python -m app.training.train [--version V] [--epochs N] [--sample N] [--no-logo] ...`` (also
``layercast train``). Stages, each a function below:

1. **load** (:func:`load_training_data`): the stored measurements (:func:`app.training.dataset.load_training_rows`,
   the one path training and retraining read; ``layercast import justus|neusight|vidur|profiler`` fill it):
   Justus et al. 2018 (TF1 session, conv/dense, forward and training steps, five GPUs), NeuSight (PyTorch
   eager fp32 kernels, P4/P100/T4/A100/MI100/MI210), Vidur (fp16 LLM ops, Kineto kernel time, A100/A40)
   and the CPU seed dataset; each GPU source subsampled per imported file (:data:`DEFAULT_SAMPLE`), every
   row featurised by :mod:`app.core.features`.
2. **split** (:func:`splits`): each source by distinct configuration (shape without the device) 70/10/20.
3. **fit** (:func:`fit_recipe`): two heads, each an ensemble of :class:`LayerTimeNet`; the GPU head on every
   GPU row (sources weighted equally), one member per feature set of :data:`MEMBER_FEATURES` (v3's datasheet
   figures, device-blind, per-SM-cycle ratios; averaged in ln ms), the CPU head on the CPU rows. The network predicts
   ``ln(time / floor)`` and cannot go below 0: ``p50 = log_floor_ms + softplus(prior + MLP)``, where the
   floor is :func:`app.core.features.pass_floor_ms` (roofline at the op's peak for the precision, cheapest
   algorithm, bytes at the precision) and the prior is ``ln(1/efficiency + overhead_ms / floor_ms)`` with a
   learned per-launch overhead per software stack (PyTorch eager, TF1 session, kernel time), pass and
   hardware kind (added, or for kernel time overlapped: :data:`KERNEL_TIME_OVERHEAD_P`), plus, for gathers,
   element-wise ops and norms (:data:`LATENCY_KINDS`), a term in work (elements or FLOPs) per SM cycle. So no
   prediction, and no p10, is ever below the physics floor.
4. **leave-one-GPU-out** (:func:`leave_one_gpu_out`): one fold per GPU chip (catalog ``architecture``: all
   A100 variants are one fold), the recipe retrained without any of its rows; the held-out chip's
   validation rows give the conformal factor of the GPU interval (:func:`conformal_factor`): the shipped
   80 % interval is calibrated on GPUs the model had not seen, not in distribution only.
5. **export** (:func:`export_onnx`, :func:`write_artifact`): one ONNX graph (both heads, normalisation,
   prior, floor, calibration baked in), torch weights for :mod:`app.training.finetune`, typed JSON metadata
   (feature list, per kind and op kind feature ranges for out-of-distribution flags, scope, data files,
   metrics, backward/forward ratios measured in the data); ``models/CURRENT`` is pointed at it.

No device id is ever a feature: hardware enters through datasheet figures (op peak at the precision,
bandwidth, SMs, clock, L2) and wave quantisation, so an unseen GPU is answered by the same smooth model.
The held-out report against the baselines is :mod:`app.training.evaluate` (``layercast evaluate``).
Deterministic for a given seed on CPU (torch deterministic algorithms, fixed thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from app.core.features import (
    DEFAULT_STACK,
    EXTRA_KINDS,
    STACKS,
    feature_index,
    roofline_ms_from_raw,
    select_features,
)
from app.core.hardware import HardwareSpec
from app.hardware.catalog import load_catalog
from app.measurements.importers import SOURCE_JUSTUS, SOURCE_NEUSIGHT, SOURCE_PROFILER, SOURCE_VIDUR
from app.predictor.roofline import fit_roofline_constants
from app.progress import bar
from app.training.dataset import TrainingRows, load_from_database, split_by_config, split_by_hash
from app.training.metrics import metrics, source_of

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "models"
MODEL_NAME = "layer-time-mlp"
QUANTILES = (0.1, 0.5, 0.9)
OPSET = 17

_KIND_ONE_HOTS = ("is_conv", "is_gemm", *(f"is_{k.value}" for k in EXTRA_KINDS))

#: The datasheet figures of the device itself (absolute and the op ridge point). A member that reads them
#: can tell the training GPUs apart and fits each one's efficiency; on a GPU it has not seen that
#: extrapolates badly (held-out P100/P4 GEMMs and convs 50-80 % too slow, A100/T4 ones 30-40 % too fast).
DATASHEET_FEATURES: tuple[str, ...] = (
    "hw_log_op_peak_flops_per_s",
    "hw_log_bandwidth_bytes_per_s",
    "hw_log_op_ridge_flops_per_byte",
    "hw_log_compute_units",
    "hw_log_clock_mhz",
    "hw_log_l2_cache_bytes",
)
#: Features the v3 model read (columns of app.core.features, by name); the datasheet-aware member of v4 reads
#: the same. Left out on purpose: the generic
#: ``peak_for(precision)`` columns (``log_roofline_ms``, ``log_compute_ms``, ``hw_log_peak_flops_per_s``,
#: ``hw_log_ridge_flops_per_byte``: a 16-bit peak is wrong for element-wise ops; the op-peak columns replace
#: them) and the device memory size (it says nothing about speed and lets the network identify a GPU).
#: The v4 feature-block candidates (per-SM ratios instead of absolute hardware figures, one model) are in
#: app.training.compare; they won the quick loop but lost on the full recipe (models/README.md).
V3_FEATURES: tuple[str, ...] = (
    "log_floor_ms",
    "log_op_compute_ms",
    "log_memory_ms",
    "log_floor_over_memory",
    "log_update_memory_ms",
    "log_flops",
    "log_bytes",
    "log_intensity",
    "log_params",
    "log_batch",
    *_KIND_ONE_HOTS,
    "log_kernel",
    "log_stride",
    "log_c_in",
    "log_c_out",
    "log_in_spatial",
    "log_out_spatial",
    "has_bias",
    "act_relu",
    "act_tanh",
    "act_sigmoid",
    "log_groups",
    "is_depthwise",
    "log_seq_len",
    "log_in_elems",
    "log_out_elems",
    "needs_input_grad",
    "is_train",
    "opt_sgd",
    "opt_momentum",
    "opt_adagrad",
    "opt_adadelta",
    "opt_adam",
    "opt_rmsprop",
    "is_half",
    "uses_tensor_cores",
    *DATASHEET_FEATURES,
    "log_gemm_m",
    "log_gemm_n",
    "log_gemm_k",
    "log_tiles",
    "log_waves",
    "wave_efficiency",
    "log_work_per_sm",
    "log_bytes_over_l2",
    "stack_tf1_session",
    "stack_kernel_time",
    "is_cpu",
)

#: Device-blind member: hardware enters only through the floor, the times (work over the op peak and the
#: bandwidth) and the wave counts over the SMs.
DEVICE_BLIND_FEATURES: tuple[str, ...] = tuple(n for n in V3_FEATURES if n not in DATASHEET_FEATURES)
#: Per-SM-cycle member: device-blind plus FLOPs and DRAM bytes per SM per cycle (NeuSight, Lee et al. ASPLOS
#: 2025: ratios that stay in a narrow range across generations; Kepler's 384 FLOPs/SM/cycle against Pascal's
#: 128-256 is what the Justus TF1 rows need).
PER_SM_CYCLE_FEATURES: tuple[str, ...] = (*DEVICE_BLIND_FEATURES, "hw_log_flops_per_sm_cycle",
                                          "hw_log_bytes_per_sm_cycle")  # fmt: skip
#: The v4 input row: every column a member reads (each member masks the others, LayerTimeNet ``active``).
MODEL_FEATURES: tuple[str, ...] = (*V3_FEATURES, "hw_log_flops_per_sm_cycle", "hw_log_bytes_per_sm_cycle")
#: The GPU head's members, one per feature set (member k reads ``MEMBER_FEATURES[k % 3]``), averaged in ln ms:
#: chosen on leave-one-GPU-out validation configurations (models/README.md), where the mix beat three
#: members of any one set.
MEMBER_FEATURES: tuple[tuple[str, ...], ...] = (V3_FEATURES, DEVICE_BLIND_FEATURES, PER_SM_CYCLE_FEATURES)
#: The latency term of the prior (:class:`LayerTimeNet`): op kinds whose kernels spend SM cycles on per-element
#: work that does not overlap their DRAM traffic, with the cycles per unit of work and SM the prior starts from.
#: Their time is ``floor / memory efficiency + cycles x work / (SMs x clock)``, a term that scales with the SMs
#: and clock instead of the DRAM bandwidth; the work is :data:`LATENCY_WORK` of the kind. Measured on Vidur's
#: fp16 ops (A100 and A40, whose DRAM floors differ 2.8x while SMs x clock differ 4 %):
#: - ``is_embedding``, work = output elements: PyTorch's embedding gather (``index_select``: integer division and
#:   offset arithmetic per element, one 2-byte load and store) runs at 0.50 and 0.59 elements per SM cycle on
#:   the two GPUs, 300-350 GB/s on both, so its time is this term (~2 cycles per element; the prior starts at 8
#:   so that the term, not the floor, sets how it moves between GPUs).
#: - ``is_elementwise`` and ``is_norm``, work = FLOPs (:mod:`app.core.costs`: add 1, RoPE 3, SiLU-and-mul 6 per
#:   output element, RMSNorm 7 per input element): above ``floor / 0.9`` the time of add, RoPE, SiLU-and-mul and
#:   RMSNorm (tokens >= 64) is 0.074 (A100) and 0.067 (A40) cycles per FLOP and SM pooled over the four ops, the
#:   same on both GPUs; one constant per kind then predicts each GPU from the other within 17 % (A100) and 10 %
#:   (A40) MAPE, where carrying the efficiency over (what an MLP that saw one GPU does) is 55 % off. With one
#:   cycles-per-element constant instead (tried before: worse or within noise) PyTorch's vectorised add, at
#:   the floor, and SiLU-and-mul, at half of it, cannot be told apart; their FLOPs can.
#: Multiply-accumulate kinds have no term (their work per output element, K MACs, is in the floor).
LATENCY_KINDS: dict[str, float] = {"is_embedding": 8.0, "is_elementwise": 0.07, "is_norm": 0.07}
#: How a latency kind's term combines with its ``floor / memory efficiency``: the p of the smooth maximum
#: ``(mem^p + lat^p)^(1/p)`` (1: a sum). The gather's index work and its DRAM traffic are in flight together
#: (p = 4): the A100's ~2.1 and the A40's ~1.7 cycles per element are its whole time, while the sum form
#: needs 1.7 and 0.75 cycles above the floor. Per-token element-wise kernels and norms fit the sum: their
#: cycles above the floor are the same on both GPUs (above).
LATENCY_OVERLAP_P: dict[str, float] = {"is_embedding": 4.0, "is_elementwise": 1.0, "is_norm": 1.0}
#: Work column of each latency kind's term (a ln feature of app.core.features).
LATENCY_WORK: dict[str, str] = {"is_embedding": "log_out_elems", "is_elementwise": "log_flops", "is_norm": "log_flops"}
#: Sharpness of the prior's combination of work and per-launch overhead for kernel time (``stack_kernel_time``:
#: summed kernel durations, no launch gaps): a kernel's fixed duration (~1-2 us: grid launch and drain) overlaps
#: its memory traffic instead of adding to it. Vidur's residual add on the A100 takes 2 us up to 48 tokens, then
#: 4 us at 256 tokens over a 3.25 us floor and 7 us at 512 over 6.5 us; floor + 2 us would be 5.3 and 8.5 us.
KERNEL_TIME_OVERHEAD_P = 4.0
#: DRAM-bandwidth efficiency the prior starts from for :data:`LATENCY_KINDS` rows (streaming kernels reach
#: ~90 % of the datasheet bandwidth; the other kinds start at 50 %, a GEMM-class compute efficiency).
MEMORY_EFFICIENCY = 0.9
#: Features the latency term reads: work / (SMs x clock) = exp(work - hw_log_compute_units - hw_log_clock_mhz)
#: / 1e6 s, the work a column of :data:`LATENCY_WORK`.
_LATENCY_COLUMNS = ("hw_log_compute_units", "hw_log_clock_mhz", *sorted(set(LATENCY_WORK.values())))

#: Sources ``layercast train`` reads (measurement ``source`` values).
V3_SOURCES: tuple[str, ...] = (SOURCE_JUSTUS, SOURCE_NEUSIGHT, SOURCE_VIDUR, SOURCE_PROFILER)

#: Measurements kept per imported file of each GPU source (seeded), the shipped run's subsample: ~60k
#: Justus, ~64k NeuSight, ~30k Vidur op rows, so that ``layercast train`` with leave-one-GPU-out runs in
#: minutes. CPU rows are all kept.
DEFAULT_SAMPLE: dict[str, int | None] = {SOURCE_JUSTUS: 6000, SOURCE_NEUSIGHT: 2500, SOURCE_VIDUR: 15000}

#: Model defaults (the shipped artifact's recipe; recorded in its metadata).
DEFAULTS: dict[str, Any] = {
    "epochs": 30,
    "hidden": 128,
    "depth": 3,
    "ensemble": 3,
    "lr": 3e-3,
    "weight_decay": 1e-5,
    "batch_size": 2048,
    "logo_ensemble": 3,  # members per leave-one-GPU-out fold (calibration and evaluation): one per feature set
    "member_features": MEMBER_FEATURES,  # GPU head: member k reads member_features[k % len]; None: all the same
    "logo_epochs": 20,  # epochs per leave-one-GPU-out fold
    "balance": "source",  # loss_weights: every source the same share ("source_family": families by sqrt(rows))
}

#: CPU head: ~10k rows, so smaller batches and more epochs than the GPU head.
CPU_HEAD: dict[str, Any] = {"epochs": 50, "batch_size": 256}


class LayerTimeNet(nn.Module):
    """Efficiency-over-floor quantile MLP; input features ``[N, F]`` (``feature_names`` columns), output ln ms
    ``[N, 3]`` at p10/p50/p90, every column ``>= log_floor_ms`` (the physics floor).

    ``p50 = log_floor_ms + softplus(prior + mlp_1)``, ``prior = logaddexp(ln(1/eff), ln overhead_ms − log_floor_ms)``:
    the time is the floor at a learned efficiency plus a learned per-launch overhead, whose log has one
    offset per non-default software stack column present (``stack_tf1_session``, ``stack_kernel_time``),
    for a training step (``is_train``) and for CPUs (``is_cpu``). With ``latency_prior`` (the default; off
    for weights saved without it) rows of :data:`LATENCY_KINDS` add ``cycles_kind x work / (SMs x clock)``
    (``latency_kinds``: the kinds covered, default all; weights saved with fewer load with those) and use
    their own (memory) efficiency: the hardware dependence of a latency-bound op comes from
    this structure, not from an MLP that saw the op on one GPU only. The MLP sees standardised features
    (mean/std buffers baked into the graph) and corrects the prior; p10/p90 sit below/above p50 by softplus
    offsets times the conformal scales ``q_scale[kind]`` (row 0 GPU, row 1 CPU; 1 until calibrated), p10
    clamped at the floor.

    ``active`` (a subset of ``feature_names``; None = all) is what the MLP reads: the other standardised
    columns are multiplied by 0 (``input_mask`` buffer), so members of one ensemble can read different
    feature sets from the same input row (a mixed ensemble, :data:`DEFAULTS` ``member_features``). Raises
    ``ValueError`` for an ``active`` name not in ``feature_names``.
    """

    mean: torch.Tensor
    std: torch.Tensor
    q_scale: torch.Tensor
    input_mask: torch.Tensor
    overlap_p: torch.Tensor

    def __init__(
        self,
        mean: np.ndarray,
        std: np.ndarray,
        *,
        feature_names: Sequence[str] = MODEL_FEATURES,
        hidden: int = 128,
        depth: int = 3,
        active: Sequence[str] | None = None,
        latency_prior: bool = True,
        latency_kinds: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        names = list(feature_names)
        if len(mean) != len(names):
            raise ValueError(f"mean has {len(mean)} columns, feature_names {len(names)}")
        unknown = sorted(set(active or ()) - set(names))
        if unknown:
            raise ValueError(f"active features {unknown} are not in feature_names")
        self.feature_names = tuple(names)
        self.hidden, self.depth = hidden, depth
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.register_buffer("q_scale", torch.ones(2, 2, dtype=torch.float32))
        keep = set(names if active is None else active)
        self.register_buffer("input_mask", torch.tensor([float(n in keep) for n in names], dtype=torch.float32))
        self.floor_i = names.index("log_floor_ms")
        self.train_i = names.index("is_train")
        self.cpu_i = names.index("is_cpu") if "is_cpu" in names else -1
        self.stack_cols = [names.index(s) for s in ("stack_tf1_session", "stack_kernel_time") if s in names]
        self.kernel_time_i = names.index("stack_kernel_time") if "stack_kernel_time" in names else -1
        # the latency term: off for weights trained without it (load_weights), or a feature list without its columns
        have = latency_prior and all(c in names for c in _LATENCY_COLUMNS)
        unknown_kinds = sorted(set(latency_kinds or ()) - set(LATENCY_KINDS))
        if unknown_kinds:
            raise ValueError(f"latency kinds {unknown_kinds} are not in LATENCY_KINDS")
        covered = [k for k in (LATENCY_KINDS if latency_kinds is None else latency_kinds) if k in names]
        self.latency_kinds = tuple(covered) if have else ()
        self.latency_cols = [names.index(c) for c in ("hw_log_compute_units", "hw_log_clock_mhz")] if have else []
        self.cycle_cols = [names.index(k) for k in self.latency_kinds]
        self.work_cols = [names.index(LATENCY_WORK[k]) for k in self.latency_kinds]
        layers: list[nn.Module] = []
        width = len(names)
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        last = nn.Linear(width, 3)
        with torch.no_grad():
            last.weight.mul_(0.1)
            last.bias.zero_()
        layers.append(last)
        self.mlp = nn.Sequential(*layers)
        self.ln_ineff = nn.Parameter(torch.tensor(math.log(2.0)))
        self.ln_ovh = nn.Parameter(torch.tensor(math.log(0.01)))  # ~10 µs per launch in PyTorch eager
        self.ln_ovh_train = nn.Parameter(torch.tensor(math.log(3.0)))
        self.ln_ovh_stack = nn.Parameter(torch.zeros(max(len(self.stack_cols), 1)))
        if self.cycle_cols:  # ln cycles per element and SM per latency kind; their own DRAM efficiency
            init = [LATENCY_KINDS[names[c]] for c in self.cycle_cols]
            overlap = [LATENCY_OVERLAP_P[names[c]] for c in self.cycle_cols]
            self.register_buffer("overlap_p", torch.tensor(overlap, dtype=torch.float32), persistent=False)
            self.ln_cycles = nn.Parameter(torch.log(torch.tensor(init, dtype=torch.float32)))
            self.ln_ineff_mem = nn.Parameter(torch.tensor(-math.log(MEMORY_EFFICIENCY)))
        self.cpu_ln_ineff = nn.Parameter(torch.tensor(0.0))
        self.cpu_ln_ovh = nn.Parameter(torch.tensor(0.0))
        self.cpu_ln_ovh_train = nn.Parameter(torch.tensor(0.0))
        #: mean training loss of each epoch of :func:`train_model` (the loss curve; not saved with the weights)
        self.loss_history: list[float] = []

    def _is_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.cpu_i] if self.cpu_i >= 0 else torch.zeros_like(x[:, 0])

    def log_overhead_ms(self, x: torch.Tensor) -> torch.Tensor:
        """ln of the learned per-launch overhead (ms) of each row ``[N]``."""
        cpu = self._is_cpu(x)
        train = x[:, self.train_i]
        out = self.ln_ovh + train * self.ln_ovh_train + cpu * (self.cpu_ln_ovh + train * self.cpu_ln_ovh_train)
        for j, col in enumerate(self.stack_cols):
            out = out + x[:, col] * self.ln_ovh_stack[j]
        return out

    def prior(self, x: torch.Tensor) -> torch.Tensor:
        """Physics prior of ``ln(time / floor)`` ``[N]`` (before the softplus): ``ln((floor / efficiency +
        cycles x sm_cycle_ms (+) overhead_ms) / floor)``. The cycles term only for :data:`LATENCY_KINDS` rows
        (``sm_cycle_ms`` = the kind's :data:`LATENCY_WORK` / (SMs x clock), ``cycles`` learned per kind), whose
        efficiency is the memory one (starts at :data:`MEMORY_EFFICIENCY`), added to the floor term or, for
        kinds with :data:`LATENCY_OVERLAP_P` above 1, combined with it as a smooth maximum. ``(+)`` is a sum,
        except for kernel time (``stack_kernel_time``), where it is the smooth maximum ``(a^p + b^p)^(1/p)``,
        p = :data:`KERNEL_TIME_OVERHEAD_P`."""
        floor = x[:, self.floor_i]
        ineff = self.ln_ineff + self._is_cpu(x) * self.cpu_ln_ineff
        terms = [ineff]  # ln(floor / efficiency) - ln floor
        if self.cycle_cols:
            kinds = x[:, self.cycle_cols]  # one-hot [N, K]
            on = kinds.sum(dim=1)
            terms[0] = ineff + on * (self.ln_ineff_mem - self.ln_ineff)
            sms, mhz = (x[:, c] for c in self.latency_cols)
            ln_work = (kinds * (x[:, self.work_cols] + self.ln_cycles)).sum(dim=1)  # ln(cycles x work), row's kind
            ln_cycle_ms = ln_work - sms - mhz - math.log(1e3)
            # rows of another kind get exp(-60) of it: nothing
            lat = ln_cycle_ms - floor - 60.0 * (1.0 - on)
            p_lat = 1.0 + (kinds * (self.overlap_p - 1.0)).sum(dim=1)  # LATENCY_OVERLAP_P of the row's kind, else 1
            work = _logsumexp(torch.stack([terms[0] * p_lat, lat * p_lat], dim=1)) / p_lat
        else:
            work = terms[0]
        ovh = self.log_overhead_ms(x) - floor
        if self.kernel_time_i < 0:
            return _logsumexp(torch.stack([work, ovh], dim=1))
        p = 1.0 + (KERNEL_TIME_OVERHEAD_P - 1.0) * x[:, self.kernel_time_i]
        return _logsumexp(torch.stack([work * p, ovh * p], dim=1)) / p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x - self.mean) / self.std * self.input_mask
        out = self.mlp(z)
        floor = x[:, self.floor_i]
        p50 = floor + nn.functional.softplus(self.prior(x) + out[:, 1])
        cpu = self._is_cpu(x)
        s_lo = self.q_scale[0, 0] + cpu * (self.q_scale[1, 0] - self.q_scale[0, 0])
        s_hi = self.q_scale[0, 1] + cpu * (self.q_scale[1, 1] - self.q_scale[0, 1])
        lo = torch.maximum(p50 - nn.functional.softplus(out[:, 0]) * s_lo, floor)
        hi = p50 + nn.functional.softplus(out[:, 2]) * s_hi
        return torch.stack([lo, p50, hi], dim=1)

    def prior_summary(self) -> dict[str, float]:
        """Learned prior constants: efficiency and per-launch overheads (ms) per stack, pass and kind."""
        ineff, ovh, tr = self.ln_ineff.item(), self.ln_ovh.item(), self.ln_ovh_train.item()
        out = {
            "gpu_efficiency": math.exp(-ineff),
            "gpu_overhead_forward_ms": math.exp(ovh),
            "gpu_overhead_train_step_ms": math.exp(ovh + tr),
            "cpu_efficiency": math.exp(-(ineff + self.cpu_ln_ineff.item())),
            "cpu_overhead_forward_ms": math.exp(ovh + self.cpu_ln_ovh.item()),
        }
        names = [self.feature_names[c] for c in self.stack_cols]
        for j, name in enumerate(names):
            out[f"gpu_overhead_forward_ms_{name}"] = math.exp(ovh + self.ln_ovh_stack[j].item())
        if self.cycle_cols:
            out["memory_efficiency"] = math.exp(-self.ln_ineff_mem.item())
        for j, c in enumerate(self.cycle_cols):
            unit = "element" if LATENCY_WORK[self.feature_names[c]] == "log_out_elems" else "flop"
            out[f"cycles_per_{unit}_per_sm_{self.feature_names[c]}"] = math.exp(self.ln_cycles[j].item())
        return out


def _logsumexp(t: torch.Tensor) -> torch.Tensor:
    """ln sum exp over dim 1 of ``t`` ``[N, K]``, written out (no ONNX symbolic for aten::logaddexp)."""
    m = t.max(dim=1).values
    return m + torch.log(torch.exp(t - m[:, None]).sum(dim=1))


class Ensemble(nn.Module):
    """Mean of the members' ln-ms quantiles (one ONNX graph for the whole ensemble)."""

    def __init__(self, members: Sequence[LayerTimeNet]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.feature_names = members[0].feature_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members], dim=0).mean(dim=0)


class KindHeads(nn.Module):
    """One ONNX graph, two heads picked per row by ``is_cpu``: the GPU ensemble and the CPU ensemble (``cpu``
    may be None: GPU-only model). Separate heads keep generalisation across GPUs independent of the one CPU
    (in one network the CPU's far-away hardware features distorted the GPU extrapolation, v2)."""

    def __init__(self, gpu: Ensemble, cpu: Ensemble | None) -> None:
        super().__init__()
        self.gpu_head = gpu
        self.cpu_head = cpu
        self.feature_names = gpu.feature_names
        self.cpu_i = list(self.feature_names).index("is_cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gpu_head(x)
        if self.cpu_head is None:
            return g
        c = self.cpu_head(x)
        return torch.where(x[:, self.cpu_i : self.cpu_i + 1] > 0.5, c, g)

    def heads(self) -> dict[str, Ensemble]:
        """``{"gpu": ..., "cpu": ...}`` (CPU only when present)."""
        return {"gpu": self.gpu_head, **({"cpu": self.cpu_head} if self.cpu_head is not None else {})}


def pinball(pred: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """(Weighted) mean pinball loss of the quantile columns of ``pred`` ``[N, 3]`` against ``y`` ``[N]``."""
    q = torch.tensor(QUANTILES, dtype=pred.dtype)
    err = y[:, None] - pred
    loss = torch.maximum(q * err, (q - 1) * err).mean(dim=1)
    if w is None:
        return loss.mean()
    return (loss * w).sum() / w.sum()


def train_model(
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    seed: int,
    feature_names: Sequence[str] = MODEL_FEATURES,
    weights: np.ndarray | None = None,
    hidden: int = 128,
    depth: int = 3,
    batch_size: int = 2048,
    lr: float = 3e-3,
    weight_decay: float = 1e-5,
    init: LayerTimeNet | None = None,
    active: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> LayerTimeNet:
    """Train a :class:`LayerTimeNet` on features ``x`` ``[N, F]`` (``feature_names`` columns) and ln ms
    targets ``y`` ``[N]`` (pinball loss, optional per-row ``weights``). ``init`` starts from a copy of an
    existing model (its normalisation and input mask kept: fine-tuning); ``active`` is the subset of
    ``feature_names`` the MLP reads (:class:`LayerTimeNet`)."""
    torch.manual_seed(seed)
    if init is not None:
        model = LayerTimeNet(
            init.mean.numpy(), init.std.numpy(), feature_names=init.feature_names, hidden=init.hidden,
            depth=init.depth, latency_prior=bool(init.cycle_cols), latency_kinds=init.latency_kinds,
        )  # fmt: skip
        model.load_state_dict(init.state_dict())  # input_mask included
        model.q_scale.fill_(1.0)
    else:
        # float64 statistics, and a column that (nearly) never varies — the hardware features of a single
        # CPU — is left unscaled: dividing by its float32 rounding noise would blow up any other device
        x64 = np.asarray(x, dtype=np.float64)
        mean = x64.mean(axis=0)
        std = x64.std(axis=0)
        std = np.where(std > 1e-3, std, 1.0)
        model = LayerTimeNet(mean, std, feature_names=feature_names, hidden=hidden, depth=depth, active=active)
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    wt = None if weights is None else torch.tensor(weights, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = max(1, math.ceil(len(y) / batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    epochs_bar = bar(range(epochs), desc=f"train (seed {seed})", unit="epoch", leave=False)
    for epoch in epochs_bar:
        perm = torch.randperm(len(y), generator=gen)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * batch_size : (i + 1) * batch_size]
            loss = pinball(model(xt[idx]), yt[idx], None if wt is None else wt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        model.loss_history.append(total / len(y))
        epochs_bar.set_postfix(loss=f"{total / len(y):.4f}", refresh=False)
        if epoch == epochs - 1 or epoch % max(1, epochs // 5) == 0:
            log(f"  epoch {epoch + 1}/{epochs} pinball {total / len(y):.4f}")
    model.eval()
    return model


def train_ensemble(
    x: np.ndarray,
    y: np.ndarray,
    *,
    n: int,
    seed: int,
    log: Callable[[str], None] = print,
    member_features: Sequence[Sequence[str]] | None = None,
    **kwargs: Any,
) -> Ensemble:
    """``n`` :func:`train_model` members with seeds ``seed, seed+1, ...``; member ``k`` reads the features
    ``member_features[k % len(member_features)]`` (all when None: every member the same features)."""
    members = []
    for k in range(n):
        t0 = time.time()
        active = member_features[k % len(member_features)] if member_features else None
        members.append(train_model(x, y, seed=seed + k, log=log, active=active, **kwargs))
        log(f"  member {k + 1}/{n} trained in {time.time() - t0:.0f}s")
    return Ensemble(members)


def predict(model: nn.Module, x: np.ndarray) -> np.ndarray:
    """ln ms quantiles ``[N, 3]`` of ``x`` ``[N, F]`` (torch, no grad)."""
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy().astype(np.float64)


def _members(model: nn.Module) -> list[LayerTimeNet]:
    if isinstance(model, KindHeads):
        return [m for head in model.heads().values() for m in _members(head)]
    if isinstance(model, Ensemble):
        return [m for m in model.members if isinstance(m, LayerTimeNet)]
    assert isinstance(model, LayerTimeNet)
    return [model]


def interval_ratios(pred_ln: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How far beyond each side of the interval ``y`` falls, in units of that side's offset (ln space)."""
    d_lo = np.maximum(pred_ln[:, 1] - pred_ln[:, 0], 1e-6)
    d_hi = np.maximum(pred_ln[:, 2] - pred_ln[:, 1], 1e-6)
    return (pred_ln[:, 1] - y) / d_lo, (y - pred_ln[:, 1]) / d_hi


def conformal_factor(ratios: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """Split-conformal factors (lo, hi) of the p10/p90 offsets: the 0.9 quantile of the pooled
    :func:`interval_ratios`, so that 10 % of those rows fall outside each side (at least 0.05)."""
    lo = np.concatenate([r[0] for r in ratios])
    hi = np.concatenate([r[1] for r in ratios])
    if not len(lo):
        return 1.0, 1.0
    return max(float(np.quantile(lo, 0.9)), 0.05), max(float(np.quantile(hi, 0.9)), 0.05)


def set_scale(model: nn.Module, kind: str, scale: tuple[float, float]) -> None:
    """Set the conformal scale of ``kind`` (``"gpu"``/``"cpu"``) in every member of ``model``."""
    row = 1 if kind == "cpu" else 0
    for m in _members(model):
        m.q_scale[row].copy_(torch.tensor([scale[0], scale[1]], dtype=torch.float32))


def calibrate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, is_cpu: np.ndarray | None = None
) -> dict[str, tuple[float, float]]:
    """Split-conformal scaling of the p10/p90 offsets on these rows (:func:`conformal_factor` of the
    unscaled offsets), separately for GPU and CPU rows (``is_cpu``; all GPU when None). Sets ``q_scale`` of
    every member (an ensemble's offsets are the mean of its members', so one common scale per kind
    calibrates the mean) and returns ``{"gpu": (lo, hi), "cpu": (lo, hi)}``."""
    for m in _members(model):
        m.q_scale.fill_(1.0)
    p = predict(model, x)
    cpu = np.zeros(len(y), dtype=bool) if is_cpu is None else np.asarray(is_cpu, dtype=bool)
    out: dict[str, tuple[float, float]] = {}
    for kind, sel in (("gpu", ~cpu), ("cpu", cpu)):
        out[kind] = conformal_factor([interval_ratios(p[sel], y[sel])]) if sel.any() else (1.0, 1.0)
        set_scale(model, kind, out[kind])
    return out


# ---------------------------------------------------------------- data


def is_cpu_rows(data: TrainingRows) -> np.ndarray:
    """Boolean ``[N]``: rows featurised against a CPU."""
    return data.features[:, feature_index("is_cpu")] > 0.5


def model_inputs(data: TrainingRows, names: Sequence[str] = MODEL_FEATURES) -> np.ndarray:
    """The model's input columns of ``data.features``."""
    return select_features(data.features, names)


def loss_weights(data: TrainingRows, balance: str = "source") -> np.ndarray:
    """Per-row loss weights, mean 1: every source (:func:`app.training.metrics.source_of`) carries the same
    share; with ``balance="source_family"`` each op family within a source carries a share proportional to
    the square root of its rows (a family with 4x the rows gets 2x the weight, so NeuSight's GEMMs and convs
    are not drowned by its 11 element-wise ops, nor those ignored). Raises ``ValueError`` for another
    ``balance``."""
    if balance not in ("source", "source_family"):
        raise ValueError(f"balance must be 'source' or 'source_family', got {balance!r}")
    src = source_of(data)
    w = np.ones(len(data))
    names = np.unique(src)
    for s in names:
        m = src == s
        w[m] = len(data) / (len(names) * m.sum())
        if balance == "source_family":
            fam = data.family[m]
            keys, counts = np.unique(fam, return_counts=True)
            share = np.sqrt(counts) / np.sqrt(counts).sum()
            per_row = dict(zip(keys.tolist(), (share * m.sum() / counts).tolist(), strict=True))
            w[m] *= np.asarray([per_row[f] for f in fam.tolist()])
    return w


def load_training_data(
    *,
    database_url: str,
    sources: Sequence[str] = V3_SOURCES,
    cpu: bool = True,
    sample: Mapping[str, int | None],
    seed: int,
    cpu_specs: Mapping[str, HardwareSpec] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[TrainingRows, TrainingRows | None, HardwareSpec | None]:
    """GPU rows of every GPU source in ``sources``, CPU rows (None without ``cpu`` or without stored CPU
    rows) and the CPU spec they use, from the measurement database
    (:func:`app.training.dataset.load_training_rows`). ``sample`` gives measurements per imported file of
    each GPU source (None = all); ``cpu_specs`` featurises CPU ids against given specs (an artifact's
    snapshot). Raises ``ValueError`` when no GPU measurement of ``sources`` is stored."""
    t0 = time.time()
    parts: list[TrainingRows] = []
    for src in sources:
        if src == SOURCE_PROFILER:
            continue
        try:
            rows = load_from_database(database_url, sources=(src,), hardware_kinds=("gpu",),
                                      sample_per_file=sample.get(src), seed=seed)  # fmt: skip
        except ValueError:
            log(f"no stored {src} GPU measurements: left out")
            continue
        log(f"loaded {len(rows)} {src} rows in {time.time() - t0:.1f}s (skipped {dict(rows.skipped)})")
        parts.append(rows)
    if not parts:
        raise ValueError(f"no stored GPU measurements of {list(sources)}: import them first (layercast import ...)")
    gpu = TrainingRows.concat(parts)
    cpu_rows: TrainingRows | None = None
    cpu_spec: HardwareSpec | None = None
    if cpu and SOURCE_PROFILER in sources:
        try:
            cpu_rows = load_from_database(database_url, sources=(SOURCE_PROFILER,), hardware_kinds=("cpu",),
                                          specs=cpu_specs)  # fmt: skip
        except ValueError:
            log("no CPU measurements stored: GPU-only model")
        if cpu_rows is not None:
            if len({str(g) for g in cpu_rows.gpu}) != 1:
                raise ValueError(f"the CPU head trains on one CPU; stored CPU rows name {sorted(set(cpu_rows.gpu))}")
            cpu_spec = cpu_rows.hardware[str(cpu_rows.gpu[0])]
            small = sample.get(SOURCE_JUSTUS)
            if small is not None and small < 1000:
                keys = np.unique(cpu_rows.config)
                keep = np.random.default_rng(seed).permutation(keys)[: max(1, small * 4)]
                cpu_rows = cpu_rows.subset(np.isin(cpu_rows.config, keep))
            log(f"loaded {len(cpu_rows)} CPU rows of {cpu_spec.id}")
    return gpu, cpu_rows, cpu_spec


def splits(
    gpu: TrainingRows, cpu: TrainingRows | None, *, seed: int
) -> tuple[TrainingRows, TrainingRows, TrainingRows]:
    """Train / validation / test, 70/10/20 by configuration within each source (GPU sources:
    :func:`split_by_config` over their configuration keys, which exclude the device; CPU:
    :func:`app.training.dataset.split_by_hash`, stable as the seed dataset grows)."""
    parts: list[tuple[TrainingRows, TrainingRows, TrainingRows]] = []
    for d, split in ((gpu, split_by_config), (cpu, split_by_hash)):
        if d is None or len(d) == 0:
            continue
        s = split(d.config, seed=seed)
        parts.append((d.subset(s == 0), d.subset(s == 1), d.subset(s == 2)))
    tr, va, te = (TrainingRows.concat([p[i] for p in parts]) for i in range(3))
    return tr, va, te


def gpu_group(ids: np.ndarray, catalog: Mapping[str, HardwareSpec]) -> np.ndarray:
    """Leave-one-GPU-out group of each hardware id: the catalog ``architecture`` (the chip: every A100
    variant is one group), else the id."""
    arch = {i: (catalog[i].architecture or i) if i in catalog else i for i in np.unique(ids)}
    return np.asarray([arch[i] for i in ids])


# ---------------------------------------------------------------- fit


def fit_recipe(
    tr: TrainingRows,
    va: TrainingRows,
    *,
    recipe: Mapping[str, Any],
    seed: int,
    ensemble: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[KindHeads, dict[str, tuple[float, float]]]:
    """Train the heads of ``recipe`` (keys of :data:`DEFAULTS`; CPU head with :data:`CPU_HEAD` overrides) on
    ``tr`` — the GPU head on its GPU rows (sources weighted equally), the CPU head on its CPU rows (none
    without) — and calibrate each on its kind's ``va`` rows (in distribution). ``ensemble`` overrides the
    members per head. Raises ``ValueError`` without GPU training rows."""
    names = tuple(recipe.get("feature_names", MODEL_FEATURES))
    heads: dict[str, Ensemble] = {}
    scales: dict[str, tuple[float, float]] = {"gpu": (1.0, 1.0), "cpu": (1.0, 1.0)}
    for kind, cpu in (("gpu", False), ("cpu", True)):
        t, v = tr.subset(is_cpu_rows(tr) == cpu), va.subset(is_cpu_rows(va) == cpu)
        if len(t) == 0:
            continue
        r = {**recipe, **(recipe.get("cpu_head", CPU_HEAD) if cpu else {})}
        heads[kind] = train_ensemble(
            model_inputs(t, names), np.log(t.time_ms), n=int(ensemble or r["ensemble"]), seed=seed, log=log,
            feature_names=names, weights=loss_weights(t, str(r.get("balance", "source"))), epochs=int(r["epochs"]),
            hidden=int(r["hidden"]), depth=int(r["depth"]), batch_size=int(r["batch_size"]), lr=float(r["lr"]),
            weight_decay=float(r["weight_decay"]), member_features=None if cpu else r.get("member_features"),
        )  # fmt: skip
        if len(v):
            scales[kind] = calibrate(heads[kind], model_inputs(v, names), np.log(v.time_ms), is_cpu_rows(v))[kind]
    if "gpu" not in heads:
        raise ValueError("no GPU training rows")
    return KindHeads(heads["gpu"], heads.get("cpu")), scales


def leave_one_gpu_out(
    tr: TrainingRows,
    va: TrainingRows,
    te: TrainingRows,
    *,
    recipe: Mapping[str, Any],
    seed: int,
    groups: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """For each GPU chip (:func:`gpu_group`): train the GPU head without any of its rows (training,
    normalisation, in-distribution calibration), predict its validation and test rows.

    Returns ``{group: {"pred_ln": [N, 3] on its test rows, "test": TrainingRows, "val_ratios": (lo, hi)
    interval misfits on its validation rows, "val_mape_pct": MAPE on its validation rows (what a recipe may
    be chosen on; the test rows are what is reported), "model": the fold model}}``.
    """
    catalog = load_catalog()
    names = tuple(recipe.get("feature_names", MODEL_FEATURES))
    recipe = {**recipe, "epochs": int(recipe.get("logo_epochs", recipe["epochs"]))}
    gtr, gva, gte = (d.subset(~is_cpu_rows(d)) for d in (tr, va, te))
    g_tr, g_va, g_te = (gpu_group(d.gpu, catalog) for d in (gtr, gva, gte))
    groups = list(groups) if groups is not None else sorted(set(g_te.tolist()))
    out: dict[str, Any] = {}
    for g in bar(groups, desc="leave-one-GPU-out", unit="fold"):
        t0 = time.time()
        model, _ = fit_recipe(gtr.subset(g_tr != g), gva.subset(g_va != g), recipe=recipe, seed=seed,
                              ensemble=int(recipe.get("logo_ensemble", 1)), log=lambda s: None)  # fmt: skip
        te_g, va_g = gte.subset(g_te == g), gva.subset(g_va == g)
        va_pred = predict(model, model_inputs(va_g, names))
        out[g] = {
            "pred_ln": predict(model, model_inputs(te_g, names)),
            "test": te_g,
            "model": model,
            "val_ratios": interval_ratios(va_pred, np.log(va_g.time_ms)),
            "val_mape_pct": metrics(va_g.time_ms, np.exp(va_pred[:, 1]))["mape_pct"] if len(va_g) else float("nan"),
        }
        m = metrics(te_g.time_ms, np.exp(out[g]["pred_ln"][:, 1])) if len(te_g) else {"mape_pct": float("nan")}
        log(f"LOGO {g}: {len(te_g)} test rows, MAPE {m['mape_pct']:.1f} %; validation rows MAPE "
            f"{out[g]['val_mape_pct']:.1f} % ({time.time() - t0:.0f}s)")  # fmt: skip
    return out


# ---------------------------------------------------------------- measured ratios


DEEPBENCH_DIR = REPO_ROOT.parent / "shared" / "data" / "deepbench"


def backward_forward_ratios(deepbench_dir: Path = DEEPBENCH_DIR) -> dict[str, Any]:
    """Backward/forward time ratios measured per op family (issue 8 item 5), from Baidu DeepBench training
    kernels, which time the forward and the backward of the same configuration on the same GPU:
    convolutions ``(bwd_data + bwd_filter) / fwd`` and recurrent layers ``bwd / fwd`` (per cell type), over
    rows whose forward is at least 0.1 ms (launch overhead below 10 %). Median, quartiles and the row count
    per family; ``{}`` when the files are absent. (The Justus rows time forward and training step of
    different random configurations, so they give no paired ratio.)"""
    import csv

    out: dict[str, Any] = {}

    def add(name: str, ratios: list[float]) -> None:
        if ratios:
            q = np.quantile(ratios, [0.25, 0.5, 0.75])
            out[name] = {"median": round(float(q[1]), 3), "q25": round(float(q[0]), 3), "q75": round(float(q[2]), 3),
                         "n": len(ratios)}  # fmt: skip

    def num(row: Mapping[str, str], key: str) -> float:
        try:
            return float(row.get(key) or "nan")
        except ValueError:
            return float("nan")

    conv, rnn = deepbench_dir / "deepbench_conv.csv", deepbench_dir / "deepbench_rnn.csv"
    if conv.is_file():
        with conv.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("mode") == "train"]
        r = [(num(x, "bwd_data_ms") + num(x, "bwd_filter_ms")) / num(x, "fwd_ms") for x in rows]
        add("conv", [v for v, x in zip(r, rows, strict=True) if math.isfinite(v) and num(x, "fwd_ms") >= 0.1])
    if rnn.is_file():
        with rnn.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("mode") == "train"]
        for cell in sorted({x.get("cell", "") for x in rows} - {""}):
            sel = [x for x in rows if x.get("cell") == cell and num(x, "fwd_ms") >= 0.1]
            add(cell, [v for v in (num(x, "bwd_ms") / num(x, "fwd_ms") for x in sel) if math.isfinite(v)])
    if out:
        out["source"] = "Baidu DeepBench training kernels (CUDA 8-10, cuDNN 6-7), ../shared/data/deepbench"
    return out


# ---------------------------------------------------------------- export


def export_onnx(model: nn.Module, path: Path, n_features: int | None = None) -> None:
    """Export ``model`` to ONNX (opset 17, dynamic batch axis) at ``path``."""
    model.eval()
    n = n_features if n_features is not None else len(getattr(model, "feature_names", MODEL_FEATURES))
    dummy = torch.zeros(4, n, dtype=torch.float32)
    torch.onnx.export(
        model,
        (dummy,),
        str(path),
        input_names=["features"],
        output_names=["log_time_ms"],
        dynamic_axes={"features": {0: "n"}, "log_time_ms": {0: "n"}},
        opset_version=OPSET,
        dynamo=False,
    )


def save_weights(model: KindHeads, path: Path) -> None:
    """Torch weights of every member (``<head>.member<k>.<state key>``) as a numpy ``.npz`` (for fine-tuning)."""
    arrays = {
        f"{head}.member{k}.{key}": v.detach().numpy()
        for head, ens in model.heads().items()
        for k, m in enumerate(ens.members)
        for key, v in m.state_dict().items()
    }
    np.savez(path, **arrays)  # type: ignore[arg-type]


def load_weights(path: Path, *, feature_names: Sequence[str], hidden: int, depth: int) -> KindHeads:
    """Inverse of :func:`save_weights`; raises ``FileNotFoundError``/``KeyError`` on a bad file."""
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    heads: dict[str, Ensemble] = {}
    for head in ("gpu", "cpu"):
        keys = [k for k in data if k.startswith(f"{head}.member")]
        if not keys:
            continue
        n = 1 + max(int(k.split(".")[1][len("member") :]) for k in keys)
        members = []
        for k in range(n):
            prefix = f"{head}.member{k}."
            sd = {key[len(prefix) :]: torch.tensor(v) for key, v in data.items() if key.startswith(prefix)}
            m = LayerTimeNet(sd["mean"].numpy(), sd["std"].numpy(), feature_names=feature_names, hidden=hidden,
                             depth=depth, latency_prior="ln_cycles" in sd,
                             latency_kinds=tuple(LATENCY_KINDS)[: len(sd["ln_cycles"])] if "ln_cycles" in sd else None)  # fmt: skip  # noqa: E501
            sd.setdefault("input_mask", m.input_mask)  # artifacts before the input mask: every feature read
            m.load_state_dict(sd)
            m.eval()
            members.append(m)
        heads[head] = Ensemble(members)
    return KindHeads(heads["gpu"], heads.get("cpu"))


def hardware_snapshot(hw: HardwareSpec) -> dict[str, Any]:
    """Spec fields stored in ``training_hardware`` (everything the features read, plus identity)."""
    from app.core.hardware import hardware_to_dict

    return hardware_to_dict(hw)


def _op_kind_of_rows(data: TrainingRows) -> np.ndarray:
    """Op kind value (``conv``, ``gemm``, ``matmul``...) of each row, from the one-hot features."""
    out = np.full(len(data), "other", dtype=object)
    for name in _KIND_ONE_HOTS:
        out[data.features[:, feature_index(name)] > 0.5] = name[len("is_") :]
    return out.astype(str)


def feature_ranges(data: TrainingRows, names: Sequence[str]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per hardware kind and op kind: min and max of every model feature over ``data`` (serving flags a
    query outside its own kind's and op kind's range as out of distribution, issue 8 item 4)."""
    x = model_inputs(data, names)
    cpu = is_cpu_rows(data)
    kinds = _op_kind_of_rows(data)
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for hw_kind, sel in (("gpu", ~cpu), ("cpu", cpu)):
        for k in np.unique(kinds[sel]):
            m = sel & (kinds == k)
            out.setdefault(hw_kind, {})[str(k)] = {
                "min": [float(v) for v in x[m].min(axis=0)],
                "max": [float(v) for v in x[m].max(axis=0)],
            }
    return out


def per_source_metrics(data: TrainingRows, pred_ln: np.ndarray) -> dict[str, Any]:
    """:func:`metrics` of ``pred_ln`` ``[N, 3]`` per source."""
    src = source_of(data)
    p = np.exp(pred_ln)
    return {str(s): metrics(data.time_ms[src == s], p[src == s, 1], p[src == s, 0], p[src == s, 2])
            for s in np.unique(src)}  # fmt: skip


def run(
    *,
    database_url: str,
    out_dir: Path,
    epochs: int,
    sample: Mapping[str, int | None],
    seed: int,
    version: str,
    sources: Sequence[str] = V3_SOURCES,
    cpu: bool = True,
    logo: bool = True,
    hidden: int = 128,
    depth: int = 3,
    ensemble: int = 3,
    threads: int = 1,
    write_current: bool = True,
    argv: Sequence[str] = (),
    log: Callable[[str], None] = print,
    keep_rows: Callable[[TrainingRows], np.ndarray] | None = None,
) -> dict[str, Any]:
    """Load, split, fit, run leave-one-GPU-out (conformal GPU interval), export; returns the metadata.
    ``keep_rows`` (a boolean mask per loaded row set) leaves rows out before the split (retraining: the
    frozen benchmark, :mod:`app.training.retrain`)."""
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    gpu, cpu_rows, cpu_spec = load_training_data(database_url=database_url, sources=sources, cpu=cpu,
                                                 sample=sample, seed=seed, log=log)  # fmt: skip
    if keep_rows is not None:
        gpu = gpu.subset(keep_rows(gpu))
        cpu_rows = None if cpu_rows is None else cpu_rows.subset(keep_rows(cpu_rows))
    tr, va, te = splits(gpu, cpu_rows, seed=seed)
    recipe = {**DEFAULTS, "epochs": epochs, "hidden": hidden, "depth": depth, "ensemble": ensemble,
              "cpu_head": CPU_HEAD}  # fmt: skip

    # roofline fallback constants (ops the learned model does not cover): Justus training rows
    g_tr, g_va = tr.subset(source_of(tr) == "justus"), va.subset(source_of(va) == "justus")
    rconst = fit_roofline_constants(
        roofline_ms=roofline_ms_from_raw(g_tr.raw), time_ms=g_tr.time_ms, is_train=g_tr.pass_ == "train_step",
        calib_roofline_ms=roofline_ms_from_raw(g_va.raw), calib_time_ms=g_va.time_ms,
        calib_is_train=g_va.pass_ == "train_step", source=f"fitted on Justus 2018 training split (seed {seed})",
    )  # fmt: skip

    log(f"training on {len(tr)} rows ({int(is_cpu_rows(tr).sum())} CPU), {ensemble} x {epochs} epochs")
    t1 = time.time()
    model, q_scale = fit_recipe(tr, va, recipe=recipe, seed=seed, log=log)
    train_s = time.time() - t1
    log(f"trained in {train_s:.1f}s; in-distribution conformal scales {q_scale}")
    out_dir.mkdir(parents=True, exist_ok=True)
    from app.training.plots import loss_curve

    curve = loss_curve(out_dir / f"{MODEL_NAME}-{version}.loss.png", title=f"{MODEL_NAME}-{version}: pinball loss",
                       curves={f"{kind} head, member {i + 1}": m.loss_history
                               for kind, head in model.heads().items() for i, m in enumerate(_members(head))})
    log(f"wrote the loss curve {curve}")

    logo_summary: dict[str, Any] = {}
    factor = (1.0, 1.0)
    if logo:
        folds = leave_one_gpu_out(tr, va, te, recipe=recipe, seed=seed, log=log)
        factor = conformal_factor([f["val_ratios"] for f in folds.values()])
        logo_summary = {g: metrics(f["test"].time_ms, np.exp(f["pred_ln"][:, 1])) for g, f in folds.items()
                        if len(f["test"])}  # fmt: skip
        logo_summary["mean_mape_pct"] = round(float(np.mean([v["mape_pct"] for v in logo_summary.values()])), 4)
        log(f"LOGO mean MAPE {logo_summary['mean_mape_pct']}; GPU interval factor {factor}")
    gpu_scale = (q_scale["gpu"][0] * factor[0], q_scale["gpu"][1] * factor[1])
    set_scale(model, "gpu", gpu_scale)

    test_pred = predict(model, model_inputs(te))
    summary = per_source_metrics(te, test_pred)
    log(f"test: { {k: v['mape_pct'] for k, v in summary.items()} }")
    meta = write_artifact(
        model, out_dir=out_dir, version=version, tr=tr, te=te, cpu_spec=cpu_spec, sources=sources,
        recipe=recipe, sample=sample, seed=seed, scales={"gpu": gpu_scale, "cpu": q_scale["cpu"]},
        in_distribution_scales=q_scale, logo_factor=factor, rconst=rconst.to_dict(), summary=summary,
        logo_summary=logo_summary, argv=argv, threads=threads, train_s=train_s,
    )  # fmt: skip
    meta["wall_time_s"] = round(time.time() - t0, 1)
    stem = f"{MODEL_NAME}-{version}"
    (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    if write_current:
        (out_dir / "CURRENT").write_text(stem + "\n")
    log(f"wrote {out_dir / stem}.onnx and .json in {meta['wall_time_s']}s")
    return meta


def write_artifact(
    model: KindHeads,
    *,
    out_dir: Path,
    version: str,
    tr: TrainingRows,
    te: TrainingRows,
    cpu_spec: HardwareSpec | None,
    sources: Sequence[str],
    recipe: Mapping[str, Any],
    sample: Mapping[str, int | None],
    seed: int,
    scales: Mapping[str, tuple[float, float]],
    in_distribution_scales: Mapping[str, tuple[float, float]],
    logo_factor: tuple[float, float],
    rconst: Mapping[str, Any],
    summary: Mapping[str, Any],
    logo_summary: Mapping[str, Any],
    argv: Sequence[str],
    threads: int,
    train_s: float,
) -> dict[str, Any]:
    """Write the ONNX graph and the torch weights; return the metadata (the caller writes the JSON)."""
    catalog = tr.hardware
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{MODEL_NAME}-{version}"
    onnx_path = out_dir / f"{stem}.onnx"
    export_onnx(model, onnx_path, len(MODEL_FEATURES))
    weights_path = out_dir / f"{stem}.weights.npz"
    save_weights(model, weights_path)
    cpu_rows = is_cpu_rows(tr)
    gpu_tr = tr.subset(~cpu_rows)
    kinds = _op_kind_of_rows(tr)
    training_hw: dict[str, Any] = {g: hardware_snapshot(catalog[g]) for g in sorted({str(g) for g in gpu_tr.gpu})}
    if cpu_spec is not None:
        training_hw[cpu_spec.id] = hardware_snapshot(cpu_spec)
    tf1 = (gpu_tr.features[:, feature_index("stack_tf1_session")] > 0.5).any()
    stacks = sorted({DEFAULT_STACK, *(["tf1-session"] if tf1 else [])})
    applies: dict[str, Any] = {
        "gpu": {
            "op_kinds": sorted(set(kinds[~cpu_rows].tolist())),
            "conv_spatial_dims": [2],
            "grouped_conv": False,
            "precision": sorted({str(p) for p in gpu_tr.precisions} | {"fp32", "tf32", "bf16"}),
            "measured_precision": sorted({str(p) for p in gpu_tr.precisions}),
            "stacks": stacks,
            "optimizers": ["none", "sgd", "momentum", "adagrad", "adadelta", "adam", "rmsprop"],
        }
    }
    if cpu_spec is not None and cpu_rows.any():
        applies["cpu"] = {
            "op_kinds": sorted(set(kinds[cpu_rows].tolist())),
            "profiler_families": sorted({str(f) for f in np.unique(tr.family[cpu_rows])}),
            "conv_spatial_dims": [1, 2],
            "grouped_conv": True,
            "precision": sorted({str(v) for v in tr.precisions[cpu_rows]}),
            "measured_precision": sorted({str(v) for v in tr.precisions[cpu_rows]}),
            "stacks": [DEFAULT_STACK],
            "optimizers": ["none", "sgd", "momentum", "adam"],
            "threads": 1,
            "hardware_ids": [cpu_spec.id],
        }
    src_tr = source_of(tr)
    return {
        "name": MODEL_NAME,
        "version": version,
        "onnx_file": onnx_path.name,
        "weights_file": weights_path.name,
        "created_unix_s": int(time.time()),
        "input": {"name": "features", "dtype": "float32", "shape": ["n", len(MODEL_FEATURES)]},
        "output": {
            "name": "log_time_ms",
            "dtype": "float32",
            "shape": ["n", 3],
            "meaning": "natural log of the layer time in ms at quantiles 0.1, 0.5, 0.9 (forward pass, or whole "
            "training step forward+backward+update); every column >= log_floor_ms (physics floor)",
        },
        "target": "ln(time / physics floor) >= 0 inside the graph (app.core.features.pass_floor_ms), returned "
        "as ln ms = log_floor_ms + softplus(prior + MLP)",
        "quantiles": list(QUANTILES),
        "feature_names": list(MODEL_FEATURES),
        "feature_function": "app.core.features.layer_features, columns feature_names (select_features)",
        "normalisation": "baked into the ONNX graph (mean/std of the training rows)",
        "feature_ranges": feature_ranges(tr, MODEL_FEATURES),
        "default_stack": DEFAULT_STACK,
        "stacks": list(STACKS),
        "applies_to": applies,
        "training_hardware": training_hw,
        "training_data": {
            "sources": list(sources),
            "database": "measurements table (app.training.dataset.load_training_rows)",
            "files": [
                {"name": f.name, "rows_read": f.rows_read, "rows_kept": f.rows_kept, "sha256": f.sha256}
                for f in tr.files
            ],  # fmt: skip
            "sample_rows_per_file": dict(sample),
            "target": "time_ms_median of each stored measurement",
            "split": "per source, by distinct configuration (shape without device, optimizer or precision), "
            "seeded shuffle, 70/10/20 train/validation/test",
            "split_seed": seed,
            "rows": {
                "train": len(tr),
                "test": len(te),
                "train_by_source": {str(s): int((src_tr == s).sum()) for s in np.unique(src_tr)},
            },  # fmt: skip
        },
        "model": {
            "architecture": f"two heads (GPU, CPU; picked by is_cpu), each an ensemble of MLPs {recipe['depth']}x"
            f"{recipe['hidden']} SiLU with quantile outputs over a floor + overhead + latency prior",
            "prior": "ln(time/floor) = softplus(ln((floor/eff + overhead_ms(stack, pass, kind) + cycles(kind) x "
            "work(kind) / (SMs x clock)) / floor) + MLP); the cycles term only for "
            + ", ".join(f"{k.removeprefix('is_')} (work {LATENCY_WORK[k].removeprefix('log_')})" for k in LATENCY_KINDS)
            + " kinds, with eff the memory efficiency there; under kernel time (stack_kernel_time) the overhead "
            f"and the rest combine as a smooth maximum (p = {KERNEL_TIME_OVERHEAD_P}), not a sum",
            "prior_constants_member0": {k: _members(h)[0].prior_summary() for k, h in model.heads().items()},
            "conformal_scales": {k: list(v) for k, v in scales.items()},
            "in_distribution_scales": {k: list(v) for k, v in in_distribution_scales.items()},
            "gpu_interval_logo_factor": list(logo_factor),
            "interval_calibration": "GPU: split-conformal scale on the validation rows times the 0.9 quantile "
            "of the misfit ratios of every leave-one-GPU-out fold on its held-out GPU; CPU: validation rows",
            "recipe": {k: v for k, v in recipe.items() if k != "feature_names"},
            "seed": seed,
            "loss": "pinball on ln ms at 0.1/0.5/0.9, sources weighted equally",
            "optimizer": "AdamW + OneCycle",
        },
        "backward_forward_ratio": backward_forward_ratios(),
        "roofline": dict(rconst),
        "metrics_test_summary": dict(summary),
        "metrics_leave_one_gpu_out_summary": dict(logo_summary),
        "reproduce": "python -m app.training.train " + " ".join(argv),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "threads": threads,
        },  # fmt: skip
        "train_wall_time_s": round(train_s, 1),
        "wall_time_s": None,
    }


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``layercast train``."""
    p = argparse.ArgumentParser(prog="layercast train", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--database-url", default=None, help="measurement database (default $LAYERCAST_DATABASE_URL)")
    p.add_argument("--sources", nargs="+", default=list(V3_SOURCES), help="measurement sources to train on")
    p.add_argument("--no-cpu", action="store_true", help="GPU rows only")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--sample", type=int, default=None, help="rows per file of every source (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version", default="4")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    p.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    p.add_argument("--ensemble", type=int, default=DEFAULTS["ensemble"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--no-logo", action="store_true", help="skip leave-one-GPU-out (GPU interval not LOGO-calibrated)")
    p.add_argument("--no-current", action="store_true", help="do not update models/CURRENT")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``layercast train`` / ``python -m app.training.train``); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(args_list)
    from app.config import Settings

    sample = dict(DEFAULT_SAMPLE) if a.sample is None else {k: a.sample for k in DEFAULT_SAMPLE}
    run(
        database_url=a.database_url or Settings().database_url, out_dir=a.out_dir, epochs=a.epochs, sample=sample,
        seed=a.seed, version=a.version, sources=a.sources, cpu=not a.no_cpu, logo=not a.no_logo, hidden=a.hidden,
        depth=a.depth, ensemble=a.ensemble, threads=a.threads, write_current=not a.no_current, argv=args_list,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
