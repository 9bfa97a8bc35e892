"""Training and inference memory footprint by component (after Hestness et al. 2019, §3).

Components, in bytes: weights; gradients (one per trainable weight, training only); optimizer state
(``states`` tensors the size of the weights, from :data:`app.core.costs.OPTIMIZERS`: 0 for SGD, 1 for
momentum, 2 for Adam/AdamW); activations saved for backward (the sum of every layer's
``saved_activation_bytes``, training only); for inference the working set is the largest
input+output pair of any single layer (activations are freed as soon as they are consumed).
Not modelled: framework/CUDA context (~0.3-1 GB on a GPU), allocator fragmentation, workspace of
convolution algorithms. They are why ``fits`` keeps a 10 % headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core.analysis import GraphAnalysis
from app.core.costs import OPTIMIZERS

HEADROOM = 0.9  # usable share of device memory, for context, fragmentation and workspaces


@dataclass(frozen=True, slots=True)
class MemoryFootprint:
    """Bytes per component; ``total_bytes`` is their sum."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes + self.activations_bytes


def footprint(analysis: GraphAnalysis, *, mode: str, optimizer: str, bytes_per_param: int = 4) -> MemoryFootprint:
    """Memory footprint of one step of ``analysis.graph`` at its batch size.

    ``mode`` is ``training`` or ``inference``. Raises ``KeyError`` for an unknown optimizer.
    """
    params = analysis.params
    weights = params * bytes_per_param
    if mode == "training":
        _, states = OPTIMIZERS[optimizer]
        return MemoryFootprint(weights, params * bytes_per_param, states * params * bytes_per_param,
                               analysis.saved_activation_bytes)
    working = 0
    for layer in analysis.graph.layers:
        working = max(working, sum(t.nbytes for t in layer.inputs) + sum(t.nbytes for t in layer.outputs))
    return MemoryFootprint(weights, 0, 0, working)


def fits(fp: MemoryFootprint, memory_bytes: float) -> bool:
    """Whether ``fp`` fits in ``memory_bytes`` with :data:`HEADROOM`."""
    return fp.total_bytes <= HEADROOM * memory_bytes
