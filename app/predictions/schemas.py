"""API schemas of cost predictions. Units are in every field name."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from app.core.precision import Precision
from app.core.vocab import SoftwareStack
from app.graphs.schemas import JsonGraphCreate
from app.hardware.schemas import HardwareCreate
from app.schemas import Identifier, Name, PositiveInt32, Schema

Mode = Literal["training", "inference"]
Optimizer = Literal["none", "sgd", "momentum", "nesterov", "adagrad", "adadelta", "rmsprop", "adam", "adamw"]

#: Description of a job's ``epochs`` (predictions, job estimates and actuals, comparisons): how they become
#: iterations (:func:`app.core.aggregate.job_iterations`).
EPOCHS_DESCRIPTION = ("epochs of dataset_size; may be fractional. A job runs whole iterations: "
                      "ceil(dataset_size / batch_size) per whole epoch (the last partial batch is one), "
                      "ceil(fraction x dataset_size / batch_size) for a fraction of one, at least 1 "
                      "(epochs 1e-9 is one iteration); the evaluation (eval_size) is counted per epoch in "
                      "proportion")


def check_checkpointing_trains(activation_checkpointing: bool, mode: Mode) -> None:
    """Raise ``ValueError`` (a 422 ``validation_error`` from a schema validator) for activation checkpointing
    outside training: it recomputes the forward pass in a backward pass that inference has not. One rule for
    :class:`PredictionCreate` and :class:`app.estimates.schemas.ComparisonCreate`, the schemas with a mode."""
    if activation_checkpointing and mode != "training":
        raise ValueError("'activation_checkpointing' applies to mode 'training' only")


class RunSettings(Schema):
    """How a training or inference run goes beyond its layers: activation checkpointing, the fixed time per
    iteration, the input pipeline, an evaluation set and checkpoint writes. Shared by a prediction
    (:class:`PredictionCreate`), a scheduler's job (:class:`app.estimates.schemas.JobSpec`) and a comparison
    (:class:`app.estimates.schemas.ComparisonCreate`), which hand these fields to the same iteration, epoch and
    job model (:mod:`app.core.aggregate`)."""

    activation_checkpointing: bool = Field(
        default=False, description="training only: keep one input per segment of sqrt(layers) layers and "
                                   "recompute the rest in backward (torch.utils.checkpoint)")
    iteration_overhead_ms: float = Field(
        default=0.0, strict=True, ge=0, le=1e9, allow_inf_nan=False,
        description="fixed time per iteration outside the layers (loss, zero_grad, framework glue)")
    loading_samples_per_s: float | None = Field(
        default=None, strict=True, gt=0, allow_inf_nan=False,
        description="samples/s the input pipeline delivers (all devices together); none = loading is free")
    loading_overlapped: bool = Field(
        default=True, description="the loader prefetches while the devices compute (DataLoader workers)")
    eval_size: int | None = Field(
        default=None, strict=True, gt=0, le=10**15,
        description="samples of an evaluation set run forward-only once per epoch")
    checkpoint_every_epochs: float | None = Field(
        default=None, strict=True, gt=0, allow_inf_nan=False,
        description="write a checkpoint (weights + optimizer state) every this many epochs")
    checkpoint_write_bytes_per_s: float | None = Field(
        default=None, strict=True, gt=0, allow_inf_nan=False, description="write bandwidth of the checkpoint storage")

    @model_validator(mode="after")
    def _pairs(self) -> RunSettings:
        """Fields that mean nothing alone are refused alone (422 at parse time, in every schema built on these
        settings), never ignored."""
        if (self.checkpoint_every_epochs is None) != (self.checkpoint_write_bytes_per_s is None):
            raise ValueError("give 'checkpoint_every_epochs' and 'checkpoint_write_bytes_per_s' together")
        if not self.loading_overlapped and self.loading_samples_per_s is None:
            raise ValueError("'loading_overlapped': false needs 'loading_samples_per_s' (without a loading rate "
                             "loading is free, overlapped or not)")
        return self


class PredictionCreate(RunSettings):
    """What to predict. Give exactly one of ``graph_id``/``graph`` and one of ``hardware_id``/``hardware``."""

    graph_id: Identifier | None = Field(default=None, description="id returned by POST /v1/graphs")
    graph: JsonGraphCreate | None = Field(default=None, description="inline JSON layer list")
    hardware_id: Identifier | None = Field(
        default=None, description="catalog id, e.g. 'p100', 'a100-sxm4-40gb', 'local'"
    )
    hardware: HardwareCreate | None = Field(
        default=None, description="inline custom hardware spec. Under the id of a stored device (catalog, 'local' "
                                  "or custom) it is that device: the fields it gives must equal the stored ones "
                                  "(else a 422 conflicting_hardware naming them in detail.fields). Its own price "
                                  "answers with price_source 'request.hardware'")
    batch_size: int = Field(strict=True, gt=0, le=1_000_000)
    mode: Mode = "training"
    optimizer: Optimizer = Field(default="sgd", description="ignored (treated as 'none') in inference mode")
    precision: Precision = Field(
        default=Precision.FP32,
        description="fp32 = PyTorch defaults (strict fp32 matmuls, TF32 cuDNN convolutions on Ampere+); "
                    "fp32-strict = no tensor cores; tf32 = matmul and conv on TF32 tensor cores; fp16/bf16 = "
                    "autocast mixed precision. A precision the device lacks is a 422 precision_not_supported.",
    )
    software_stack: SoftwareStack = Field(
        default=SoftwareStack.PYTORCH_EAGER,
        description="what launches the kernels; sets the fixed per-kernel and per-layer overheads. "
                    "pytorch-cuda-graph and cuda-library run on GPUs only: on a CPU device they are a 422 "
                    "stack_not_supported.",
    )
    dims: dict[Name, PositiveInt32] = Field(
        default_factory=dict, description="symbolic dimensions other than the batch"
    )
    dataset_size: int | None = Field(default=None, strict=True, gt=0, le=10**15, description="samples per epoch")
    epochs: float | None = Field(default=None, strict=True, gt=0, le=1e6, allow_inf_nan=False,
                                 description=EPOCHS_DESCRIPTION)
    device_count: int = Field(
        default=1, strict=True, ge=1, le=4096,
        description="data-parallel devices; batch_size is the GLOBAL batch and must divide evenly over them. "
                    "Gradients are ring all-reduced over the hardware's interconnect in 25 MiB DDP buckets, which "
                    "in training each device holds as one more copy of its gradients "
                    "(memory.ddp_gradient_buckets_bytes)")
    nodes: int = Field(
        default=1, strict=True, ge=1, le=4096,
        description="nodes the device_count devices sit on (device_count / nodes each, evenly, at most 8: an "
                    "8-GPU DGX/HGX node; more is a 422 too_many_devices_per_node with detail.nodes_needed): the "
                    "all-reduce is hierarchical, inside nodes over the hardware's interconnect and between them "
                    "over the inter-node network")
    inter_node_bandwidth_bytes_per_s: float | None = Field(
        default=None, strict=True, gt=0, le=1e15, allow_inf_nan=False,
        description="network bandwidth per node and direction, all its NICs together (nodes > 1); default "
                    "25e9: one InfiniBand HDR 200 Gb/s NIC per node")
    inter_node_latency_s: float | None = Field(
        default=None, strict=True, gt=0, le=1, allow_inf_nan=False,
        description="network latency per ring step (nodes > 1); default 6.6e-6")
    price_usd_per_hour: float | None = Field(
        default=None, strict=True, gt=0, allow_inf_nan=False,
        description="price per device-hour (USD) of the job's cost_usd (needs epochs); default: the catalog's "
                    "on-demand list price")
    grid_gco2_per_kwh: float | None = Field(
        default=None, strict=True, ge=0, allow_inf_nan=False,
        description="grid carbon intensity for the job's CO2 estimate (needs epochs)")
    detail: Literal["summary", "layers"] = Field(
        default="layers", description="'layers': one row per layer in 'layers'; 'summary': totals, iteration, "
                                      "epoch, job and memory only ('layers' is empty)")

    @model_validator(mode="after")
    def _exactly_one(self) -> PredictionCreate:
        if (self.graph_id is None) == (self.graph is None):
            raise ValueError("give exactly one of 'graph_id' or 'graph'")
        if (self.hardware_id is None) == (self.hardware is None):
            raise ValueError("give exactly one of 'hardware_id' or 'hardware'")
        check_checkpointing_trains(self.activation_checkpointing, self.mode)
        if self.epochs is not None and self.dataset_size is None:
            raise ValueError("'epochs' needs 'dataset_size'")
        if self.eval_size is not None and self.dataset_size is None:
            raise ValueError("'eval_size' needs 'dataset_size'")
        if self.batch_size % self.device_count:
            raise ValueError(f"batch_size {self.batch_size} (the global batch) does not divide evenly over "
                             f"device_count {self.device_count}")
        if self.device_count % self.nodes:
            raise ValueError(f"device_count {self.device_count} does not spread evenly over nodes {self.nodes}")
        if self.nodes == 1 and (self.inter_node_bandwidth_bytes_per_s or self.inter_node_latency_s):
            raise ValueError("'inter_node_bandwidth_bytes_per_s' and 'inter_node_latency_s' need nodes > 1")
        if self.checkpoint_every_epochs is not None and self.epochs is None:
            raise ValueError("'checkpoint_every_epochs' needs 'epochs'")
        for name in ("price_usd_per_hour", "grid_gco2_per_kwh"):  # they price the job (cost_usd, co2_kg) only
            if getattr(self, name) is not None and self.epochs is None:
                raise ValueError(f"'{name}' needs 'epochs' (and 'dataset_size'): it applies to the job only")
        return self

    @property
    def per_device_batch_size(self) -> int:
        return self.batch_size // self.device_count


class LayerPrediction(Schema):
    """One layer: analytical cost for the whole batch and predicted times (null when unsupported)."""

    name: str
    op_type: str
    kind: str
    method: str = Field(description="'learned', 'roofline' or 'unsupported'")
    params: int
    forward_macs: int
    forward_flops: int
    backward_flops: int
    bytes_read: int
    bytes_written: int
    operational_intensity_flops_per_byte: float
    bound: str | None = Field(description="'compute' or 'memory' on this hardware (roofline)")
    roofline_ms: float | None = Field(
        description="max(FLOPs / peak, bytes / bandwidth) of forward (+ backward in training), at the request's "
                    "precision (peak each op may use, bytes at the precision's storage types), direct algorithm")
    physics_floor_ms: float | None = Field(
        description="the time no kernel can beat: the roofline with the FLOPs of the cheapest algorithm the "
                    "library may pick (Winograd for 3x3 stride-1 convolutions), summed over forward, backward and "
                    "update")
    floor_clamped: bool = Field(default=False, description="a pass was raised to its physics floor")
    fused_from: list[str] = Field(default_factory=list, description="graph nodes this layer was fused from")
    fusion_rule: str | None = Field(default=None, description="attention, gelu, bias, activation_epilogue or pointwise")
    forward_ms: float | None
    backward_ms: float | None
    update_ms: float | None
    total_ms: float | None
    total_ms_p10: float | None
    total_ms_p90: float | None
    out_of_distribution: bool


class UnsupportedLayers(Schema):
    op_type: str
    count: int
    layers: list[str]
    reason: str


class IterationPrediction(Schema):
    """One training step (forward + backward + update) or one inference batch, on every device
    (``app/core/aggregate.py``): time = max(layers + overhead + exposed all-reduce, input) when loading
    overlaps compute, their sum otherwise."""

    time_ms: float
    time_ms_p10: float
    time_ms_p90: float
    forward_ms: float
    backward_ms: float
    update_ms: float
    samples_per_s: float = Field(description="global batch / iteration time")
    device_count: int
    nodes: int = Field(description="nodes the devices sit on")
    devices_per_node: int
    per_device_batch_size: int
    layers_ms: float = Field(description="sum of the layers' forward + backward + update on one device "
                                         "(in training the loss layer's loss_ms included)")
    loss_ms: float = Field(
        description="training: the cross-entropy loss on the graph's output (NLL only when the graph ends in "
                    "its own Softmax/LogSoftmax), forward + backward "
                                 "(a layer after the graph's last, part of layers_ms); 0 in inference")
    overhead_ms: float = Field(description="the request's iteration_overhead_ms")
    gradient_bytes: int = Field(description="bytes all-reduced per step (fp32 gradients; 0 on one device)")
    allreduce_ms: float = Field(description="ring all-reduce of all gradient buckets back to back")
    allreduce_exposed_ms: float = Field(description="the part backward does not hide (last bucket + excess)")
    allreduce_buckets: int
    input_ms: float = Field(description="global batch / loading_samples_per_s (0 when not given)")
    input_exposed_ms: float = Field(description="loading time not hidden behind compute")
    scaling_efficiency: float = Field(
        description="iteration time without communication / with it (1.0 on one device)")
    energy_j: float | None = Field(description="estimated energy of one iteration on all devices (null: no TDP)")
    average_power_w: float | None = Field(description="estimated mean power per device over the iteration")


class EpochPrediction(Schema):
    dataset_size: int
    iterations_per_epoch: int
    time_s: float
    time_s_p10: float
    time_s_p90: float
    eval_size: int | None
    eval_iterations: int = Field(description="ceil(eval_size / batch_size) forward-only passes")
    eval_s: float
    energy_j: float | None
    energy_kwh: float | None


class JobPrediction(Schema):
    """Whole iterations + epochs × the epoch's evaluation + checkpoint writes (for whole epochs: epochs ×
    epoch + checkpoint writes); energy, money and CO2 are estimates (see ``assumptions``)."""

    epochs: float
    iterations: int = Field(description="training iterations of the whole job: ceil(dataset_size / batch_size) per "
                                        "whole epoch + ceil(fraction x dataset_size / batch_size) for a fraction "
                                        "of one, at least 1")
    time_s: float
    time_s_p10: float
    time_s_p90: float
    time_h: float
    checkpoints: int
    checkpoint_bytes: int = Field(description="one checkpoint file: fp32 weights + optimizer state as torch.save "
                                              "writes them (parameters x 4 B x (1 + optimizer states per "
                                              "parameter)), the same on every device")
    checkpoint_s: float = Field(description="all checkpoint writes of the job")
    device_hours: float
    energy_j: float | None
    energy_kwh: float | None
    price_usd_per_hour: float | None = Field(description="per device-hour: the request's or the catalog list price")
    price_source: str | None
    cost_usd: float | None = Field(description="device_hours × price_usd_per_hour (null without a price)")
    grid_gco2_per_kwh: float | None
    co2_kg: float | None = Field(description="energy_kwh × grid intensity (null without an intensity)")


class MemoryPrediction(Schema):
    """Peak memory of one step by component (``app/core/memory.py``). Under fp16/bf16 autocast the weights
    stay fp32 (the master copy; in inference, weights the graph stores in fp16/bf16 stay so, at 2 bytes), 16-bit
    copies of the GEMM/conv weights are cached and saved, activations of GEMM/conv layers are 16-bit; gradients
    and optimizer state are fp32. On several devices in training the model is assumed wrapped in PyTorch's
    DistributedDataParallel with its defaults, whose gradient buckets are a component of their own."""

    precision: str
    activation_checkpointing: bool
    weights_bytes: int = Field(description="fp32 parameters (in fp16/bf16 inference, 16-bit-stored weights at 2 B)")
    weight_copies_bytes: int = Field(description="autocast's 16-bit weight copies (0 in fp32)")
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int = Field(description="saved for backward at the end of forward, loss and output included")
    backward_transient_bytes: int = Field(description="peak's excess over the end of forward: gradients "
                                                      "accumulated, activation gradients in flight, workspace")
    runtime_bytes: int = Field(description="device context and library workspace (0 on a CPU)")
    ddp_gradient_buckets_bytes: int = Field(
        description="DistributedDataParallel's flat all-reduce buckets (device_count > 1 in training): one more "
                    "fp32 copy of every gradient, in 25 MiB buckets (the first 1 MiB), resident for the whole "
                    "step, as PyTorch's default gradient_as_bucket_view=False keeps them beside the .grad "
                    "tensors; 0 on one device and in inference")
    total_bytes: int = Field(description="predicted peak")
    device_memory_bytes: float
    usable_fraction: float = Field(description="share of device memory counted as usable (allocator fragmentation)")
    fits: bool
    largest_batch_size_that_fits: int = Field(description="largest per-device batch whose predicted peak fits")


class LossLayer(Schema):
    """The loss layer a training step runs after the graph (not one of ``layers``): its analytical cost for the
    whole batch, as a layer row gives it; its time is ``iteration.loss_ms``."""

    name: str = Field(description="'loss/cross_entropy' after logits, 'loss/nll' after the graph's own softmax")
    op_type: str
    kind: str
    method: str = Field(description="how its time was estimated: 'learned' or 'roofline'")
    forward_flops: int
    backward_flops: int
    bytes_read: int = Field(description="forward + backward")
    bytes_written: int = Field(description="forward + backward")


class Totals(Schema):
    """The answer's analytical totals. FLOPs cover what the timed step runs: the costed layers and, in training,
    the loss layer after them (``loss``), as ``iteration.layers_ms`` includes ``iteration.loss_ms``."""

    layers: int
    layers_costed: int
    layers_unsupported: int
    params: int
    forward_macs: int
    forward_flops: int = Field(description="costed layers (in training the loss layer's included)")
    backward_flops: int = Field(description="costed layers and, in training, the loss layer; 0 in inference")
    loss: LossLayer | None = Field(description="training: the loss layer counted in the FLOPs above; null in "
                                               "inference or without a floating-point output")
    totals_exclude_unsupported: bool


class PredictionRead(Schema):
    graph_id: str | None
    graph_name: str
    hardware_id: str
    hardware_name: str
    batch_size: int
    mode: Mode
    optimizer: str
    precision: Precision
    precision_semantics: str = Field(description="what the precision meant for this answer")
    software_stack: SoftwareStack = Field(description="the software stack the overheads assume")
    predictor_version: str
    methods: dict[str, int] = Field(description="layer count per method")
    layers: list[LayerPrediction]
    unsupported: list[UnsupportedLayers]
    totals: Totals
    iteration: IterationPrediction
    epoch: EpochPrediction | None
    job: JobPrediction | None
    memory: MemoryPrediction
    warnings: list[str]
    assumptions: dict[str, Any]
