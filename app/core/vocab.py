"""The measurement vocabulary shared by every layer of the project: software stack, granularity, pass.

Pure (no FastAPI, database or torch). The measurements domain stores these values, the trainer reads
them, the profiler writes them and the API schemas derive their literals from them, so each word is
defined once, here (STYLE.md: "the vocabulary is one set of enums that the schemas derive their
literals from").
"""

from __future__ import annotations

from enum import StrEnum


class SoftwareStack(StrEnum):
    """The software that launched the measured work; it sets the fixed per-kernel and per-layer overheads.

    * ``tf1-session``: a TensorFlow 1.x graph run through ``Session.run`` (Justus et al. 2018): the
      session dispatch is inside every timed iteration.
    * ``pytorch-eager``: PyTorch eager mode, one Python dispatch and one (or a few) kernel launches per op
      (NeuSight, Vidur, the project's profiler); the default a request assumes.
    * ``pytorch-cuda-graph``: PyTorch ops captured once and replayed as a CUDA graph (no per-op launch).
    * ``pytorch-compiled``: ``torch.compile`` (Inductor) graphs: fused kernels, no per-op dispatch.
    * ``cuda-library``: a vendor library kernel called from C++ without a framework (DeepBench:
      cuDNN / cuBLAS / NCCL benchmarks): no framework dispatch at all.
    """

    TF1_SESSION = "tf1-session"
    PYTORCH_EAGER = "pytorch-eager"
    PYTORCH_CUDA_GRAPH = "pytorch-cuda-graph"
    PYTORCH_COMPILED = "pytorch-compiled"
    CUDA_LIBRARY = "cuda-library"


#: The stacks that exist on GPUs only: a CUDA graph is a CUDA construct (``torch.cuda.CUDAGraph``) and a
#: ``cuda-library`` kernel is a cuDNN / cuBLAS / NCCL call; neither can launch work on a CPU, so an answer for
#: a CPU device under them is refused (HTTP 422 ``stack_not_supported``), never silently costed as another
#: stack. ``tf1-session``, ``pytorch-eager`` and ``pytorch-compiled`` all run on CPUs (TensorFlow's CPU
#: kernels; PyTorch eager CPU ops; Inductor's C++/OpenMP CPU backend) and stay accepted there.
GPU_ONLY_STACKS: frozenset[SoftwareStack] = frozenset({SoftwareStack.PYTORCH_CUDA_GRAPH, SoftwareStack.CUDA_LIBRARY})


def stack_runs_on(stack: SoftwareStack, hardware_kind: str) -> bool:
    """Whether ``stack`` can launch work on a device of ``hardware_kind`` (``"gpu"`` or ``"cpu"``): every stack
    on a GPU, all but :data:`GPU_ONLY_STACKS` elsewhere. The one test behind the predictions' and the
    measurements' ``stack_not_supported``."""
    return hardware_kind == "gpu" or stack not in GPU_ONLY_STACKS


class Granularity(StrEnum):
    """What one measured time covers.

    * ``kernel``: one op's device work (its kernels), without framework work around it: a vendor-library
      call (DeepBench), one PyTorch op between two CUDA events (NeuSight) or the summed kernel durations
      of one op under Kineto (Vidur, launch gaps excluded).
    * ``layer``: one framework layer timed from the host, dispatch and launch included (Justus: one
      layer per TF session iteration; the profiler's per-layer rows).
    * ``iteration``: a whole model's forward or training step (the profiler's end-to-end rows).
    * ``job``: a whole training job (epochs × iterations, start-up and evaluation included) as a cluster
      scheduler measured it (``POST /v1/job-estimates/actuals``).
    """

    KERNEL = "kernel"
    LAYER = "layer"
    ITERATION = "iteration"
    JOB = "job"


class Pass(StrEnum):
    """What part of training or inference a time covers.

    ``forward`` is an inference forward (eval mode, no grad; also the one execution of a collective);
    ``train_forward``/``backward``/``update`` are the three phases of one training step and
    ``train_step`` their sum (forward + backward + optimizer update); ``backward_input`` /
    ``backward_weight`` split the backward into the gradient w.r.t. the input and w.r.t. the weights.
    """

    FORWARD = "forward"
    TRAIN_FORWARD = "train_forward"
    BACKWARD = "backward"
    UPDATE = "update"
    TRAIN_STEP = "train_step"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"


#: Every :class:`Pass` value, in definition order (the profiler's ``timings`` keys).
TIMED_PASSES: tuple[str, ...] = tuple(p.value for p in Pass)
