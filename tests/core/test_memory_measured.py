"""The memory estimate against torch itself: saved-tensor hooks and live storage bytes of a real step.

Uses the harness of ``scripts/measure_memory.py`` on small models (a CNN with max-pool and dropout, a
BN+ReLU6 inverted-residual net, an LSTM LM, GPT-2 with fused attention), fp32 and bf16 autocast, so that a
regression in any per-op rule moves a ratio out of its band.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from app.core.analysis import analyze
from app.core.memory import ddp_bucket_sizes, footprint
from app.core.onnx_import import import_onnx

torch = pytest.importorskip("torch")

_SPEC = importlib.util.spec_from_file_location(
    "measure_memory", Path(__file__).resolve().parents[2] / "scripts" / "measure_memory.py")
assert _SPEC is not None and _SPEC.loader is not None
mm = importlib.util.module_from_spec(_SPEC)
sys.modules["measure_memory"] = mm
_SPEC.loader.exec_module(mm)

CASES = {c.name.split(" ")[0]: c for c in mm.CASES}


def _cpu_runs_bf16_lstm() -> bool:
    """Whether this CPU's torch runs an LSTM under bf16 autocast: oneDNN's bf16 LSTM needs AVX-512 (on an
    AVX2-only CPU it raises "could not create a primitive descriptor for the LSTM forward propagation
    primitive"), so there is no bf16 LSTM to measure there."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(4, 4)(torch.randn(2, 1, 4))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "batch"), [("AlexNet-small", 8), ("MobileNetV2", 4), ("LSTM", 4),
                                             ("GPT-2-mini", 2)])
def test_estimate_matches_saved_tensors_and_peak(name: str, batch: int, bf16: bool) -> None:
    if bf16 and name == "LSTM" and not _cpu_runs_bf16_lstm():
        pytest.skip("this CPU's torch has no bf16 LSTM to measure (oneDNN needs AVX-512); its fp32 case runs")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = CASES[name]
    model = case.build().train()
    onnx_bytes = mm.export(model, case.example(batch), case)
    opt = torch.optim.Adam(model.parameters())
    model(case.example(batch)).float().sum().backward()
    opt.step()
    est = mm.estimate(onnx_bytes, batch, case, bf16=bf16)
    meas = mm.measure(model, case.example(batch), opt, bf16=bf16)
    saved = est.activations_bytes + est.weight_copies_bytes
    assert 0.9 <= saved / meas["activations"] <= 1.1, (name, bf16, saved, meas)
    assert est.weights_bytes == meas["weights"]
    assert 0 <= meas["optimizer_state"] - est.optimizer_state_bytes <= 1024  # + Adam's scalar step counters
    assert mm.LOW <= est.total_bytes / meas["peak"] <= mm.HIGH, (name, bf16, est.total_bytes, meas)


@pytest.fixture
def gloo(tmp_path: Path):  # noqa: ANN201
    """A one-rank gloo process group (what DistributedDataParallel needs to build its reducer on a CPU)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "same_buckets"), [("ResNet-18", True), ("GPT-2-mini", False)])
def test_ddp_buckets_match_the_reducer(gloo, name: str, same_buckets: bool) -> None:  # noqa: ANN001
    """DistributedDataParallel's own buckets (seen by a comm hook, after the first iteration rebuilt them in the
    order the gradients arrived) against ddp_bucket_sizes and the footprint's ddp_gradient_buckets_bytes: the same
    fp32 bytes under bf16 autocast, a copy beside every .grad (gradient_as_bucket_view=False), and on ResNet-18
    the same buckets (GPT-2's LayerNorm parameters arrive a little out of graph order: 1 KiB moves)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = CASES[name]
    model = case.build().train()
    x = case.example(2)
    a = analyze(import_onnx(mm.export(model, x, case), batch_size=2, dims=case.dims))
    ddp = DistributedDataParallel(model)
    seen: list[tuple[int, torch.dtype, int]] = []

    def hook(_state: object, bucket):  # noqa: ANN001, ANN202
        buf = bucket.buffer()
        seen.append((buf.numel() * buf.element_size(), buf.dtype, buf.untyped_storage().data_ptr()))
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # the second iteration runs on the rebuilt buckets
        seen.clear()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
        out.float().sum().backward()
    sizes = [n for n, _, _ in seen]
    est = ddp_bucket_sizes(a.graph.layers)
    assert all(dtype == torch.float32 for _, dtype, _ in seen)
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert not grads & {ptr for _, _, ptr in seen}  # the buckets are not the gradients' storage
    assert sum(sizes) == sum(est) == sum(p.numel() * 4 for p in model.parameters())
    assert len(sizes) == len(est)
    if same_buckets:
        assert sizes == est
    fp = footprint(a, mode="training", optimizer="adam", precision="bf16", data_parallel=True)
    assert fp.ddp_gradient_buckets_bytes == sum(sizes)  # a CPU rounds no block
