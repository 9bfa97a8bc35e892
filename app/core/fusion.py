"""What frameworks fuse: multi-tensor optimizer steps and graph patterns that run as one kernel.

Pure (no I/O, no torch). Two parts:

* **Multi-tensor (foreach) optimizer steps.** PyTorch's optimizers on CUDA default to ``foreach=True``
  (PyTorch >= 2.0): each ``_foreach_*`` op of a step launches one kernel per group of up to
  :data:`TENSORS_PER_LAUNCH` parameter tensors (``depth_to_max_tensors`` of
  ``aten/src/ATen/native/cuda/MultiTensorApply.cuh``: 110, 64, 48, 36, 30 for 1 to 5 tensor lists; 48 is
  the depth-3 value, typical of the ops of an SGD-momentum or Adam step), not one kernel per layer.
  :func:`update_kernel_launches` gives a layer's share of those launches.
* **Graph fusion** (:func:`fuse_graph`): Erf-GELU chains, bias + activation after a GEMM/conv, and the
  attention core (MatMul, scale, mask, Softmax, dropout, MatMul) become one layer each; a fused layer keeps
  the FLOPs of its members and loses the intermediate tensors' DRAM traffic.
"""

from __future__ import annotations

from collections.abc import Mapping

# ``_foreach_*`` calls per step in PyTorch's ``_multi_tensor_<name>`` implementations (torch/optim/*.py,
# PyTorch 2.x, default hyper-parameters, no weight decay): SGD ``_foreach_add_``; momentum
# ``_foreach_mul_``, ``_foreach_add_`` (buffer) + ``_foreach_add_`` (params); Adam ``_foreach_add_`` (step),
# ``_foreach_lerp_``, ``_foreach_mul_``, ``_foreach_addcmul_``, ``_foreach_sqrt``, ``_foreach_div_``,
# ``_foreach_add_``, ``_foreach_addcdiv_``; AdamW one more (decoupled decay ``_foreach_mul_``). Counted from
# the sources; an estimate for versions that differ.
FOREACH_KERNELS_PER_STEP: Mapping[str, int] = {
    "none": 0, "sgd": 1, "momentum": 3, "nesterov": 4, "adagrad": 4, "adadelta": 6, "rmsprop": 4,
    "adam": 8, "adamw": 9,
}
TENSORS_PER_LAUNCH = 48


def update_kernel_launches(param_tensors: int, optimizer: str) -> float:
    """Kernel launches of a foreach optimizer step attributable to a layer with ``param_tensors`` tensors.

    ``FOREACH_KERNELS_PER_STEP[optimizer] × param_tensors / TENSORS_PER_LAUNCH`` (fractional: the launches
    are shared with the other layers' tensors of the same group). 0 for no parameters or ``"none"``.
    Raises ``KeyError`` for an optimizer not in :data:`FOREACH_KERNELS_PER_STEP`.
    """
    if param_tensors < 0:
        raise ValueError(f"param_tensors must be >= 0, got {param_tensors}")
    return FOREACH_KERNELS_PER_STEP[optimizer] * param_tensors / TENSORS_PER_LAUNCH
