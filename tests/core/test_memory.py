"""Training memory: per-op saved tensors, autocast dtypes, loss, device runtime, checkpointing, batch search."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from app.core.analysis import analyze
from app.core.hardware import SPEC_MEMO_SIZE, HardwareSpec, per_spec, spec_fingerprint
from app.core.json_import import import_json
from app.core.memory import (
    CPU_RUNTIME,
    DEVICE_RUNTIME,
    GPU_DEFAULT_RUNTIME,
    HEADROOM,
    MIB,
    DeviceRuntime,
    _rounded,
    _rounded_nonnegative,
    ddp_bucket_sizes,
    device_key,
    fits,
    footprint,
    footprint_key,
    largest_batch_that_fits,
    memory_layout,
    runtime_for,
)

DOC = {"input_shape": [3, 32, 32], "layers": [
    {"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"},
    {"op": "flatten"}, {"op": "linear", "out_features": 10}]}
CONV_W, FC_W = 16 * 27, 16 * 1024 * 10
PARAMS = CONV_W + 16 + FC_W + 10


def _a(batch: int = 4, doc: dict = DOC):
    return analyze(import_json(doc, batch_size=batch))


def _gpu(arch: str | None) -> HardwareSpec:
    return HardwareSpec(id="g", name="g", vendor="NVIDIA", kind="gpu", peak_flops_per_s={"fp32": 1e13},
                        memory_bytes=16 * 2**30, memory_bandwidth_bytes_per_s=1e12, compute_units=80,
                        architecture=arch)


@pytest.mark.parametrize(("opt", "states"), [("sgd", 0), ("momentum", 1), ("adam", 2), ("adamw", 2)])
def test_fp32_components_and_saved_tensors(opt: str, states: int) -> None:
    fp = footprint(_a(), mode="training", optimizer=opt)
    assert fp.weights_bytes == fp.gradients_bytes == 4 * PARAMS
    assert fp.optimizer_state_bytes == 4 * states * PARAMS
    assert fp.weight_copies_bytes == 0 and fp.runtime_bytes == 0
    # conv saves its input (the graph input), relu its output, flatten is a view and the linear layer saves
    # the same relu output (counted once); the loss's log-softmax and the model output are alive too
    assert fp.activations_bytes == 4 * (4 * 3 * 1024 + 4 * 16 * 1024 + 4 * 10 + 4 * 10)
    assert fp.total_bytes >= fp.weights_bytes + fp.optimizer_state_bytes + fp.activations_bytes


def test_a_graph_ending_in_softmax_keeps_no_second_log_softmax() -> None:
    """The loss after the graph's own softmax is NLL on its output (app.core.analysis.loss_layer): no fp32
    log-probabilities of its own, as the time counts no second softmax."""
    doc = {**DOC, "layers": [*DOC["layers"], {"op": "softmax"}]}
    fp = footprint(_a(doc=doc), mode="training", optimizer="sgd")
    # as above, the softmax saves its output (which is the model output): no loss log-softmax
    assert fp.activations_bytes == 4 * (4 * 3 * 1024 + 4 * 16 * 1024 + 4 * 10)
    # a view after the softmax moves no value: the same loss, the same memory (and no log-softmax either)
    viewed = footprint(_a(doc={**doc, "layers": [*doc["layers"], {"op": "flatten"}]}), mode="training",
                       optimizer="sgd")
    assert viewed.activations_bytes == fp.activations_bytes
    assert viewed.backward_transient_bytes == fp.backward_transient_bytes


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocast_keeps_fp32_state_and_saves_16_bit_copies(precision: str) -> None:
    fp32 = footprint(_a(), mode="training", optimizer="adam")
    mixed = footprint(_a(), mode="training", optimizer="adam", precision=precision)
    assert mixed.weights_bytes == mixed.gradients_bytes == 4 * PARAMS  # fp32 master weights and gradients
    assert mixed.optimizer_state_bytes == fp32.optimizer_state_bytes == 8 * PARAMS
    assert mixed.weight_copies_bytes == 2 * (CONV_W + FC_W)  # autocast's cache of the conv/linear weights
    # 16-bit copy of the input (what the conv saves), 16-bit relu output, fp32 log-softmax, 16-bit logits
    assert mixed.activations_bytes == 2 * 4 * 3 * 1024 + 2 * 4 * 16 * 1024 + 4 * 40 + 2 * 40


def test_inference_has_no_gradients_or_state() -> None:
    fp = footprint(_a(), mode="inference", optimizer="none")
    assert fp.gradients_bytes == fp.optimizer_state_bytes == 0
    assert fp.activations_bytes == 4 * 2 * (4 * 16 * 1024)  # largest layer in + out (the relu)


def test_inference_under_autocast_keeps_weights_stored_in_16_bits_at_2_bytes() -> None:
    """A model held in fp16 (an fp16 graph, as LLM inference servers run it) takes 2 bytes per parameter under
    fp16/bf16 inference, autocast leaving its weights as they are; the same graph in fp32 keeps 4, and an fp16
    graph asked in fp32 is answered with fp32 weights."""
    half_doc = {**DOC, "input_dtype": "float16"}
    assert footprint(_a(doc=half_doc), mode="inference", optimizer="none", precision="fp16").weights_bytes == 2 * PARAMS
    assert footprint(_a(doc=half_doc), mode="inference", optimizer="none", precision="bf16").weights_bytes == 2 * PARAMS
    assert footprint(_a(), mode="inference", optimizer="none", precision="fp16").weights_bytes == 4 * PARAMS
    assert footprint(_a(doc=half_doc), mode="inference", optimizer="none", precision="fp32").weights_bytes == 4 * PARAMS


def test_bn_dropout_maxpool_save_statistics_masks_and_indices() -> None:
    doc = {"input_shape": [8, 16, 16], "layers": [
        {"op": "batchnorm"}, {"op": "maxpool", "kernel_size": 2}, {"op": "dropout", "p": 0.5},
        {"op": "flatten"}, {"op": "linear", "out_features": 4}]}
    fp = footprint(_a(2, doc), mode="training", optimizer="sgd")
    x, pooled = 2 * 8 * 16 * 16, 2 * 8 * 8 * 8
    # BN: input + mean/invstd per channel; max-pool: input (= BN output) + int64 indices; dropout on a CPU:
    # an fp32 mask (input * bernoulli); linear: the dropout output; loss and logits
    expected = 4 * x + 2 * 4 * 8 + 4 * x + 8 * pooled + 4 * pooled + 4 * pooled + 2 * 4 * 2 * 4
    assert fp.activations_bytes == expected
    # CUDA's native_dropout keeps a bool mask: 3 B/element less, even after 512-B block rounding
    gpu = footprint(_a(2, doc), mode="training", optimizer="sgd", hardware=_gpu("Ampere (GA100)"))
    assert gpu.activations_bytes <= expected - 3 * pooled + 512 * 8


def test_gpu_runtime_context_workspace_and_rounding() -> None:
    assert runtime_for(None) is CPU_RUNTIME and CPU_RUNTIME.rounded(1001) == 1001
    assert runtime_for(_gpu("Volta (GV100)")) is DEVICE_RUNTIME["volta"]
    assert runtime_for(_gpu("Hopper (GH100)")) is DEVICE_RUNTIME["hopper"]
    assert runtime_for(_gpu("Ada Lovelace (AD102)")) is DEVICE_RUNTIME["ada"]
    assert runtime_for(_gpu("CDNA 3")) is DEVICE_RUNTIME["cdna"]
    assert runtime_for(_gpu(None)) is GPU_DEFAULT_RUNTIME and GPU_DEFAULT_RUNTIME.context_bytes > 0
    rt = DEVICE_RUNTIME["volta"]
    assert rt.rounded(1) == 512 and rt.rounded(513) == 1024 and rt.rounded(11 * 2**20 + 1) == 12 * 2**20
    cpu = footprint(_a(), mode="training", optimizer="adam")
    gpu = footprint(_a(), mode="training", optimizer="adam", hardware=_gpu("Volta (GV100)"))
    assert gpu.runtime_bytes == rt.context_bytes + rt.workspace_bytes
    assert gpu.weights_bytes > cpu.weights_bytes and gpu.activations_bytes > cpu.activations_bytes  # 512 B blocks
    assert gpu.total_bytes > gpu.runtime_bytes + gpu.weights_bytes + gpu.optimizer_state_bytes
    assert all(r.source for r in DEVICE_RUNTIME.values())


def test_activation_checkpointing_keeps_segment_inputs_only() -> None:
    layers = [{"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "relu"}] * 32
    doc = {"input_shape": [3, 32, 32], "layers": [*layers, {"op": "flatten"}, {"op": "linear", "out_features": 10}]}
    a = _a(8, doc)
    plain = footprint(a, mode="training", optimizer="sgd")
    ckpt = footprint(a, mode="training", optimizer="sgd", activation_checkpointing=True)
    assert ckpt.activation_checkpointing and ckpt.activations_bytes < 0.5 * plain.activations_bytes
    assert ckpt.total_bytes < plain.total_bytes
    mem = 64 * 2**20
    assert (largest_batch_that_fits(a, memory_bytes=mem, mode="training", optimizer="sgd",
                                    activation_checkpointing=True)
            > largest_batch_that_fits(a, memory_bytes=mem, mode="training", optimizer="sgd"))


def test_batch_rescaling_and_largest_batch_that_fits() -> None:
    a4 = _a(4)
    assert footprint(a4, mode="training", optimizer="adam", batch_size=8) == footprint(
        _a(8), mode="training", optimizer="adam")
    mem = 64 * 2**20
    best = largest_batch_that_fits(a4, memory_bytes=mem, mode="training", optimizer="adam")
    assert best == largest_batch_that_fits(_a(8), memory_bytes=mem, mode="training", optimizer="adam") > 4
    assert fits(footprint(_a(best), mode="training", optimizer="adam"), mem)
    assert not fits(footprint(_a(best + 1), mode="training", optimizer="adam"), mem)
    assert footprint(_a(best + 1), mode="training", optimizer="adam").total_bytes > HEADROOM * mem


def test_nothing_fits_when_model_state_exceeds_memory() -> None:
    assert largest_batch_that_fits(_a(), memory_bytes=1000, mode="training", optimizer="adam") == 0


def test_unknown_precision_optimizer_mode_or_batch_raises() -> None:
    with pytest.raises(KeyError):
        footprint(_a(), mode="training", optimizer="adam", precision="fp8")
    with pytest.raises(KeyError):
        footprint(_a(), mode="training", optimizer="lion")
    with pytest.raises(ValueError, match="mode"):
        footprint(_a(), mode="serving", optimizer="adam")
    with pytest.raises(ValueError, match="batch_size"):
        footprint(_a(), mode="training", optimizer="adam", batch_size=0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["Volta (GV100)", "Hopper (GH100)", None])
def test_a_kept_layout_sizes_every_batch_as_the_walk_does(precision: str, arch: str | None) -> None:
    """footprint() with the layout built once equals footprint() walking the layers itself, at every batch
    and with checkpointing, on the device it was built for and on any device of its kind; a layout of
    another precision or device kind is refused."""
    layers = [{"op": "conv2d", "out_channels": 16, "kernel_size": 3, "padding": 1}, {"op": "batchnorm"},
              {"op": "relu"}, {"op": "maxpool", "kernel_size": 2}, {"op": "dropout", "p": 0.1}] * 2
    doc = {"input_shape": [3, 32, 32], "layers": [*layers, {"op": "flatten"}, {"op": "linear", "out_features": 10}]}
    a, hw = _a(4, doc), _gpu(arch) if arch else None
    layout = memory_layout(a, precision=precision, hardware=hw)
    for batch in (None, 1, 3, 4, 64, 4097):
        for ckpt in (False, True):
            kw = {"mode": "training", "optimizer": "adam", "precision": precision, "hardware": hw,
                  "activation_checkpointing": ckpt, "batch_size": batch}
            assert footprint(a, layout=layout, **kw) == footprint(a, **kw)
            if hw is not None:  # another GPU generation (another runtime: context, workspace) sizes it too
                other_gpu = {**kw, "hardware": _gpu("CDNA 3")}
                assert footprint(a, layout=layout, **other_gpu) == footprint(a, **other_gpu)
    assert largest_batch_that_fits(a, memory_bytes=2**30, mode="training", optimizer="adam", precision=precision,
                                   hardware=hw, layout=layout) == largest_batch_that_fits(
        a, memory_bytes=2**30, mode="training", optimizer="adam", precision=precision, hardware=hw)
    other = "fp16" if precision == "fp32" else "fp32"
    with pytest.raises(ValueError, match="another precision or device kind"):
        footprint(a, mode="training", optimizer="adam", precision=other, hardware=hw, layout=layout)
    with pytest.raises(ValueError, match="another precision or device kind"):
        footprint(a, mode="training", optimizer="adam", precision=precision,
                  hardware=None if hw is not None else _gpu("CDNA 3"), layout=layout)


def test_runtimes_with_the_same_numbers_share_a_footprint_key() -> None:
    """A ROCm device and a CUDA one whose runtime constants are equal (documented apart) share the memo key of
    their footprints, and their footprints are indeed equal; other numbers or another kind never share one."""
    ampere, cdna = _gpu("Ampere (GA100)"), _gpu("CDNA 3")
    assert device_key(ampere) != device_key(cdna)  # the runtimes differ in their sources
    assert footprint_key(ampere) == footprint_key(cdna)
    assert footprint_key(ampere) != footprint_key(_gpu("Hopper (GH100)"))
    assert footprint_key(ampere) != footprint_key(_gpu("Ada Lovelace (AD102)"))
    assert footprint_key(None) != footprint_key(_gpu("Volta (GV100)"))
    for precision in ("fp32", "bf16"):
        for mode in ("training", "inference"):
            a = _a(batch=8)
            same = [footprint(a, mode=mode, optimizer="adam", precision=precision, hardware=hw, batch_size=b)
                    for hw in (ampere, cdna) for b in (None, 3)]
            assert same[:2] == same[2:]


def test_devices_of_one_generation_share_a_device_key() -> None:
    assert device_key(_gpu("Volta (GV100)")) == device_key(_gpu("Turing (TU102)"))  # equal runtime constants
    assert device_key(_gpu("Volta (GV100)")) != device_key(_gpu("Hopper (GH100)"))
    assert device_key(None) == device_key(HardwareSpec(
        id="c", name="c", vendor="x", kind="cpu", peak_flops_per_s={"fp32": 1e11}, memory_bytes=2**34,
        memory_bandwidth_bytes_per_s=1e10, compute_units=8))


def test_device_keys_are_computed_once_per_spec_object() -> None:
    """``per_spec`` computes a key once per spec object (a prediction reads its spec's keys per footprint), never
    answers one object with another's entry, and keeps only the last SPEC_MEMO_SIZE objects; the memoised keys
    are the ones computed afresh."""
    calls: list[HardwareSpec] = []
    memo: dict[int, tuple[HardwareSpec, object]] = {}

    def compute(hw: HardwareSpec) -> str:
        calls.append(hw)
        return hw.id

    a, b = _gpu("Ampere (GA100)"), replace(_gpu("Ampere (GA100)"), id="b")
    assert [per_spec(memo, a, compute) for _ in range(3)] == ["g"] * 3
    assert per_spec(memo, b, compute) == "b"
    assert calls == [a, b]
    specs = [replace(a, id=f"s{i}") for i in range(SPEC_MEMO_SIZE + 5)]
    assert [per_spec(memo, s, compute) for s in specs] == [s.id for s in specs]
    assert len(memo) == SPEC_MEMO_SIZE and all(entry[0] is specs[-1 - i] for i, entry in
                                               enumerate(reversed(memo.values())))
    hw = _gpu("Hopper (GH100)")
    assert footprint_key(hw) == footprint_key(hw) == footprint_key(replace(hw))
    assert device_key(hw) == (runtime_for(hw), True) and device_key(hw) is device_key(hw)
    assert spec_fingerprint(hw) == repr(hw) == spec_fingerprint(replace(hw))


# four linear layers sized to cross DDP's bucket limits (1 MiB for the first bucket, 25 MiB after): in the
# order backward makes their gradients (the last layer first) the buckets close after fc3's weight (32 MiB)
# and hold fc3.b, fc2, fc1 in the leftover one
MLP = {"input_shape": [256], "layers": [
    {"op": "linear", "out_features": 1024}, {"op": "relu"}, {"op": "linear", "out_features": 4096}, {"op": "relu"},
    {"op": "linear", "out_features": 2048}, {"op": "relu"}, {"op": "linear", "out_features": 10}]}
MLP_BUCKETS = [4 * (2048 * 10 + 10 + 4096 * 2048), 4 * (2048 + 1024 * 4096 + 4096 + 256 * 1024 + 1024)]


def test_ddp_buckets_are_filled_in_backward_order_up_to_the_caps() -> None:
    """torch's _compute_bucket_assignment_by_size over the gradients in the order they are ready, with DDP's
    default limits [1 MiB, 25 MiB] (tests/core/test_memory_measured.py checks it against a DDP run)."""
    a = _a(8, MLP)
    assert ddp_bucket_sizes(a.graph.layers) == MLP_BUCKETS
    assert sum(MLP_BUCKETS) == 4 * a.params
    assert ddp_bucket_sizes(_a().graph.layers) == [4 * PARAMS]  # under 1 MiB: one bucket
    assert MLP_BUCKETS[0] >= 1 * MIB and MLP_BUCKETS[1] < 25 * MIB


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_data_parallel_adds_one_fp32_copy_of_the_gradients(precision: str, checkpointing: bool) -> None:
    """DistributedDataParallel (gradient_as_bucket_view=False, PyTorch's default) keeps its own flat bucket
    buffers beside the .grad tensors for the whole step: one more copy of every gradient, in the gradients'
    fp32 (the master copy's type under autocast)."""
    a = _a(8, MLP)
    opts = {"mode": "training", "optimizer": "adam", "precision": precision,
            "activation_checkpointing": checkpointing}
    one = footprint(a, **opts)
    ddp = footprint(a, **opts, data_parallel=True)
    assert one.ddp_gradient_buckets_bytes == 0
    assert ddp.ddp_gradient_buckets_bytes == one.gradients_bytes == 4 * a.params  # a CPU rounds no block
    assert ddp.total_bytes - one.total_bytes == ddp.ddp_gradient_buckets_bytes
    assert ddp.model_state_bytes - one.model_state_bytes == ddp.ddp_gradient_buckets_bytes
    assert ddp.activations_bytes == one.activations_bytes
    assert ddp.backward_transient_bytes == one.backward_transient_bytes
    # on a GPU each bucket is one allocation, rounded as the caching allocator rounds it
    gpu = _gpu("Hopper (GH100)")
    g_one, g_ddp = (footprint(a, **opts, hardware=gpu, data_parallel=dp) for dp in (False, True))
    runtime = runtime_for(gpu)
    assert g_ddp.ddp_gradient_buckets_bytes == sum(runtime.rounded(b) for b in MLP_BUCKETS)
    assert g_ddp.total_bytes - g_one.total_bytes == g_ddp.ddp_gradient_buckets_bytes


def test_data_parallel_lowers_the_largest_batch_that_fits() -> None:
    a = _a(8, MLP)
    mem = 400 * MIB
    one = largest_batch_that_fits(a, memory_bytes=mem, mode="training", optimizer="adam")
    ddp = largest_batch_that_fits(a, memory_bytes=mem, mode="training", optimizer="adam", data_parallel=True)
    assert 0 < ddp < one
    assert fits(footprint(a, mode="training", optimizer="adam", batch_size=ddp, data_parallel=True), mem)
    assert not fits(footprint(a, mode="training", optimizer="adam", batch_size=ddp + 1, data_parallel=True), mem)
    assert fits(footprint(a, mode="training", optimizer="adam", batch_size=ddp + 1), mem)


def test_data_parallel_applies_to_training_only() -> None:
    with pytest.raises(ValueError, match="data_parallel"):
        footprint(_a(), mode="inference", optimizer="none", data_parallel=True)


@pytest.mark.parametrize("runtime", [DEVICE_RUNTIME["ampere"], CPU_RUNTIME,
                                     DeviceRuntime(0, 0, 500, 3 * MIB, 7 * MIB, "not powers of two")])
def test_the_vectorised_rounding_equals_the_allocators(runtime: DeviceRuntime) -> None:
    """The compiled walk rounds its byte counts in numpy (with masks for power-of-two blocks, an explicit sign
    test unless every count is >= 0): each element as :meth:`DeviceRuntime.rounded` rounds it."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.integers(-5000, 5000, 2000), rng.integers(0, 64 * MIB, 2000),
                        np.asarray([0, 1, 511, 512, 513, 10 * MIB - 1, 10 * MIB, 10 * MIB + 1, 2**40 + 3])])
    want = [runtime.rounded(int(v)) for v in x]
    assert _rounded(x, runtime).tolist() == want
    pos = x[x >= 0]
    assert _rounded_nonnegative(pos, runtime).tolist() == [runtime.rounded(int(v)) for v in pos]
