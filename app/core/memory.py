"""Training and inference memory footprint by component (after Hestness et al. 2019, §3).

Components, in bytes:

* **weights**: parameters in the working precision (4 B for fp32; 2 B for fp16/bf16 mixed precision);
* **master weights**: mixed precision only, an fp32 copy the optimizer updates (4 B per parameter);
* **gradients** (training): one per parameter in the working precision;
* **optimizer state** (training): ``states`` fp32 tensors the size of the weights, from
  :data:`app.core.costs.OPTIMIZERS` (0 for SGD, 1 for momentum, 2 for Adam/AdamW), always fp32;
* **activations**: training: every layer's ``saved_activation_bytes`` (what autograd keeps for
  backward), rescaled to 2 B per element under mixed precision; inference: the largest input+output
  pair of any single layer (activations are freed as soon as they are consumed).

Mixed precision follows the fp16 weights/grads + fp32 master + fp32 state scheme of Micikevicius et al.
2018 and ZeRO (Rajbhandari et al. 2020): with Adam, 2 (weights) + 2 (gradients) + 4 (master) + 8 (two
moments) = 16 bytes per parameter, the same as fp32's 4 + 4 + 8: mixed precision halves the
activations, not the model state. Not modelled: framework/CUDA context (~0.3-1 GB on a GPU), allocator fragmentation and
caching, convolution workspaces, temporaries alive during backward (an output gradient and an input
gradient at a time), the loss. They are why ``fits`` keeps a 10 % headroom. Measured against torch on
CPU in docs/memory_validation.md (``scripts/measure_memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core.analysis import GraphAnalysis
from app.core.costs import OPTIMIZERS
from app.core.ir import BYTES_PER_ELEMENT

HEADROOM = 0.9  # usable share of device memory, for context, fragmentation and workspaces

# precision → (bytes per weight/gradient/activation element, fp32 master copy?)
PRECISIONS: dict[str, tuple[int, bool]] = {
    "fp32": (4, False), "tf32": (4, False), "fp16": (2, True), "bf16": (2, True),  # tf32: fp32 storage
}


@dataclass(frozen=True, slots=True)
class MemoryFootprint:
    """Bytes per component; ``total_bytes`` is their sum."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    master_weights_bytes: int = 0
    precision: str = "fp32"

    @property
    def total_bytes(self) -> int:
        """Sum of all components."""
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes + self.activations_bytes
                + self.master_weights_bytes)

    @property
    def model_state_bytes(self) -> int:
        """Everything that does not scale with the batch: weights, master copy, gradients, optimizer state."""
        return self.total_bytes - self.activations_bytes


def _activation_bytes(analysis: GraphAnalysis, *, mode: str, element_bytes: int | None) -> int:
    """Saved (training) or working-set (inference) activation bytes, optionally re-sized per element."""

    def resize(nbytes: int, dtype: str) -> int:
        own = BYTES_PER_ELEMENT.get(dtype, 4)
        if element_bytes is None or not dtype.startswith(("float", "bfloat")):
            return nbytes
        return nbytes * element_bytes // own

    if mode == "training":
        return sum(
            resize(c.saved_activation_bytes, layer.outputs[0].dtype if layer.outputs else "float32")
            for layer, c in zip(analysis.graph.layers, analysis.costs, strict=True)
            if c.supported
        )
    working = 0
    for layer in analysis.graph.layers:
        ts = (*layer.inputs, *layer.outputs)
        working = max(working, sum(resize(t.nbytes, t.dtype) for t in ts))
    return working


def footprint(
    analysis: GraphAnalysis,
    *,
    mode: str,
    optimizer: str,
    bytes_per_param: int = 4,
    precision: str = "fp32",
) -> MemoryFootprint:
    """Memory footprint of one step of ``analysis.graph`` at its batch size, in bytes per component.

    ``mode`` is ``training`` or ``inference``; ``optimizer`` a key of :data:`OPTIMIZERS`;
    ``precision`` ``fp32`` (weights ``bytes_per_param`` B, activations as in the graph) or ``fp16``/``bf16``
    mixed precision (2 B weights, gradients and activations, fp32 master weights and optimizer state).
    Raises ``KeyError`` for an unknown optimizer or precision.
    """
    elem, master = PRECISIONS[precision]
    params = analysis.params
    w_bytes = params * (elem if master else bytes_per_param)
    act = _activation_bytes(analysis, mode=mode, element_bytes=elem if master else None)
    if mode == "training":
        _, states = OPTIMIZERS[optimizer]
        return MemoryFootprint(
            weights_bytes=w_bytes,
            gradients_bytes=w_bytes,
            optimizer_state_bytes=states * params * (4 if master else bytes_per_param),
            activations_bytes=act,
            master_weights_bytes=4 * params if master else 0,
            precision=precision,
        )
    return MemoryFootprint(w_bytes, 0, 0, act, 0, precision)


def fits(fp: MemoryFootprint, memory_bytes: float) -> bool:
    """Whether ``fp`` fits in ``memory_bytes`` with :data:`HEADROOM`."""
    return fp.total_bytes <= HEADROOM * memory_bytes


def largest_batch_that_fits(
    analysis: GraphAnalysis,
    *,
    memory_bytes: float,
    mode: str,
    optimizer: str,
    bytes_per_param: int = 4,
    precision: str = "fp32",
    max_batch: int = 1 << 20,
) -> int:
    """Largest batch size whose footprint fits in ``memory_bytes`` (with :data:`HEADROOM`); 0 if none.

    Model state (weights, master copy, gradients, optimizer state) does not depend on the batch;
    activations are linear in it, because every activation tensor of the graph carries the batch axis
    (attention's S×S scores included: they grow with the sequence, not the batch). So the activations
    per sample are ``activations_bytes / graph.batch_size`` of this analysis and
    ``batch = ⌊(HEADROOM · memory − model state) / per-sample activations⌋``, capped at ``max_batch``.
    Raises ``KeyError`` like :func:`footprint`.
    """
    fp = footprint(analysis, mode=mode, optimizer=optimizer, bytes_per_param=bytes_per_param, precision=precision)
    free = HEADROOM * memory_bytes - fp.model_state_bytes
    if free <= 0:
        return 0
    per_sample = fp.activations_bytes / analysis.graph.batch_size
    if per_sample <= 0:
        return max_batch
    return int(min(max_batch, free // per_sample))
