"""Timing engine: statistics, the phase loop with fake clocks (CPU and the CUDA-event path without a
GPU), and real measurements of tiny configurations of every family."""

from __future__ import annotations

from typing import Any

import pytest

from app.profiler.sampler import LayerConfig
from app.profiler.timing import (
    CpuClock,
    CudaClock,
    make_clock,
    summarize,
    time_phases,
)

# ------------------------------------------------------------------ statistics


def test_summarize_quartiles_like_numpy() -> None:
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median_ms, s.q1_ms, s.q3_ms, s.min_ms, s.max_ms, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert s.iqr_ms == 2.0 and s.rel_iqr == pytest.approx(2 / 3)
    assert s.std_ms == pytest.approx(1.5811388, rel=1e-6)
    np = pytest.importorskip("numpy")
    xs = [0.3, 1.7, 0.9, 4.2, 2.2, 0.8]
    s = summarize(xs)
    assert s.q1_ms == pytest.approx(np.percentile(xs, 25)) and s.q3_ms == pytest.approx(np.percentile(xs, 75))
    assert summarize([2.5]).std_ms == 0.0
    with pytest.raises(ValueError):
        summarize([])


def test_stats_to_dict_rounds_to_significant_digits() -> None:
    d = summarize([0.0123456789, 0.0123456789]).to_dict(digits=4)
    assert d["median_ms"] == 0.01235 and d["n"] == 2


# ------------------------------------------------------------------ phase loop with a fake CPU clock


class FakeTimeline:
    """A clock whose time advances only when a phase 'runs'."""

    def __init__(self) -> None:
        self.ns = 0

    def counter(self) -> int:
        return self.ns

    def phase(self, ms: float) -> Any:
        def run() -> None:
            self.ns += int(ms * 1e6)
        return run


def test_time_phases_separates_phases_and_sums_per_rep() -> None:
    tl = FakeTimeline()
    calls = {"before": 0}

    def before() -> None:
        calls["before"] += 1
        tl.ns += 10**9  # untimed work must not leak into any phase

    out = time_phases([("a", tl.phase(2.0)), ("b", tl.phase(3.0))], clock=CpuClock(tl.counter), warmup=2,
                      reps=5, before_rep=before, total_name="total")
    assert out["a"].median_ms == 2.0 and out["b"].median_ms == 3.0 and out["total"].median_ms == 5.0
    assert out["a"].n == out["total"].n == 5 and out["a"].rel_iqr == 0.0
    assert calls["before"] == 2 + 5


def test_time_phases_budget_stops_early_after_min_reps() -> None:
    tl = FakeTimeline()
    wall = {"t": 0.0}

    def slow() -> None:
        tl.ns += 10**6
        wall["t"] += 1.0  # each repetition takes 1 s of wall clock

    out = time_phases([("x", slow)], clock=CpuClock(tl.counter), warmup=5, reps=50, min_reps=3, budget_s=2.0,
                      wall=lambda: wall["t"])
    assert out["x"].n == 3  # budget spent: stop at min_reps
    # warm-up stopped after one repetition (a quarter of the budget used), then 3 timed ones
    assert wall["t"] == 4.0


def test_time_phases_validates_arguments() -> None:
    with pytest.raises(ValueError):
        time_phases([], clock=CpuClock())
    with pytest.raises(ValueError):
        time_phases([("x", lambda: None)], clock=CpuClock(), reps=0)


def test_exceptions_of_a_phase_propagate() -> None:
    def boom() -> None:
        raise RuntimeError("oom")

    with pytest.raises(RuntimeError, match="oom"):
        time_phases([("x", boom)], clock=CpuClock())


# ------------------------------------------------------------------ CUDA-event path, with fakes


class FakeCuda:
    """Stands in for ``torch.cuda``: events take the 'GPU' time when they are recorded; the GPU runs
    ``lag`` ms behind, so reading an event before synchronising it would be wrong."""

    def __init__(self) -> None:
        self.gpu_ms = 0.0
        self.synced = 0
        self.log: list[str] = []
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "timing events must be created with enable_timing=True"
                self.t: float | None = None
                self.done = False

            def record(self) -> None:
                self.t = cuda.gpu_ms
                cuda.log.append("record")

            def synchronize(self) -> None:
                self.done = True
                cuda.log.append("sync")

            def elapsed_time(self, end: Event) -> float:
                assert self.t is not None and end.t is not None
                assert end.done, "elapsed_time read before the end event completed"
                return end.t - self.t

        self.Event = Event

    def synchronize(self) -> None:
        self.synced += 1

    def kernel(self, ms: float) -> Any:
        def run() -> None:
            self.gpu_ms += ms  # asynchronous launch: only GPU time advances
        return run


def test_cuda_clock_times_phases_with_events() -> None:
    cuda = FakeCuda()
    clock = make_clock("cuda:0", cuda=cuda)
    assert isinstance(clock, CudaClock) and clock.kind == "cuda_event"
    out = time_phases([("forward", cuda.kernel(1.5)), ("backward", cuda.kernel(3.0)),
                       ("update", cuda.kernel(0.25))], clock=clock, warmup=2, reps=4, total_name="train_step")
    assert out["forward"].median_ms == 1.5 and out["backward"].median_ms == 3.0
    assert out["update"].median_ms == 0.25 and out["train_step"].median_ms == 4.75
    assert cuda.synced >= 1  # device synchronised after warm-up
    assert cuda.log.count("record") == (2 + 4) * 4  # one event per phase boundary


def test_cuda_clock_synchronises_before_reading() -> None:
    cuda = FakeCuda()
    clock = CudaClock(cuda)
    a = clock.mark()
    cuda.kernel(2.0)()
    b = clock.mark()
    assert clock.elapsed_ms(a, b) == 2.0 and b.done
    clock.synchronize()
    assert cuda.synced == 1


def test_make_clock_cpu() -> None:
    assert isinstance(make_clock("cpu"), CpuClock)


# ------------------------------------------------------------------ real measurements (torch, tiny)

TINY: list[LayerConfig] = [
    LayerConfig("conv2d", "conv2d", 2, (3, 8, 8),
                {"op": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1}, optimizer="momentum"),
    LayerConfig("conv2d_depthwise", "conv2d", 2, (4, 8, 8),
                {"op": "conv2d", "out_channels": 4, "kernel_size": 3, "groups": 4, "bias": False},
                optimizer="sgd"),
    LayerConfig("conv1d", "conv1d", 2, (3, 16), {"op": "conv1d", "out_channels": 4, "kernel_size": 3},
                optimizer="sgd"),
    LayerConfig("linear", "linear", 3, (5, 8), {"op": "linear", "out_features": 6}, optimizer="adam"),
    LayerConfig("matmul", "matmul", 2, shapes={"a": [2, 2, 4, 8], "b": [2, 2, 8, 4]}),
    LayerConfig("attention", "attention", 2,
                shapes={"heads": 2, "seq_q": 6, "seq_kv": 6, "head_dim": 8, "causal": True}),
    LayerConfig("lstm", "lstm", 2, (5, 8), {"op": "lstm", "hidden_size": 6, "bidirectional": True},
                optimizer="adam"),
    LayerConfig("gru", "gru", 2, (5, 8), {"op": "gru", "hidden_size": 6}, optimizer="sgd"),
    LayerConfig("batchnorm", "batchnorm", 4, (3, 4, 4), {"op": "batchnorm"}, optimizer="sgd"),
    LayerConfig("layernorm", "layernorm", 2, (5, 8), {"op": "layernorm"}, optimizer="sgd"),
    LayerConfig("groupnorm", "groupnorm", 2, (4, 4, 4), {"op": "groupnorm", "num_groups": 2}, optimizer="sgd"),
    LayerConfig("instancenorm", "instancenorm", 2, (4, 4, 4), {"op": "instancenorm"}, optimizer="sgd"),
    LayerConfig("maxpool", "maxpool", 2, (3, 8, 8), {"op": "maxpool", "kernel_size": 3, "stride": 2, "padding": 1}),
    LayerConfig("avgpool", "avgpool", 2, (3, 8, 8), {"op": "avgpool", "kernel_size": 2}),
    LayerConfig("global_pool", "global_avgpool", 2, (3, 4, 4), {"op": "global_avgpool"}),
    LayerConfig("activation", "gelu", 2, (5, 8), {"op": "gelu"}),
    LayerConfig("softmax", "softmax", 2, (2, 6, 6), {"op": "softmax"}),
    LayerConfig("embedding", "embedding", 2, (7,), {"op": "embedding", "num_embeddings": 20, "embedding_dim": 4},
                needs_input_grad=False, optimizer="adam"),
    LayerConfig("dropout", "dropout", 2, (5, 8), {"op": "dropout"}),
]


@pytest.mark.parametrize("config", TINY, ids=[c.family for c in TINY])
def test_measure_config_every_family(config: LayerConfig) -> None:
    pytest.importorskip("torch")
    from app.profiler.timing import measure_config

    st = measure_config(config, warmup=1, reps=3, budget_s=1.0, split_backward=True)
    for k in ("forward", "train_forward", "backward", "train_step"):
        assert st[k].n >= 3 and st[k].median_ms > 0, k
    assert ("update" in st) == (config.optimizer != "none")
    has_split = config.needs_input_grad and config.params() > 0
    assert ("backward_input" in st) == ("backward_weight" in st) == has_split


@pytest.mark.parametrize("config", [c for c in TINY if c.spec is not None], ids=lambda c: c.family)
def test_torch_module_output_shape_matches_json_import(config: LayerConfig) -> None:
    torch = pytest.importorskip("torch")
    from app.profiler.timing import build_case

    case = build_case(config)
    with torch.no_grad():
        out = case.forward()
    assert tuple(out.shape) == config.to_layers()[-1].outputs[0].shape
    ir_params = config.params()
    assert sum(p.numel() for p in case.params) == ir_params


def test_bf16_measurement() -> None:
    torch = pytest.importorskip("torch")
    from app.profiler.timing import build_case, measure_config

    cfg = TINY[3]
    case = build_case(cfg, precision="bf16")
    assert case.params[0].dtype == torch.bfloat16
    st = measure_config(cfg, precision="bf16", warmup=1, reps=3, budget_s=1.0)
    assert st["train_step"].median_ms > 0


def test_device_context_records_the_conditions() -> None:
    torch = pytest.importorskip("torch")
    from app.profiler.timing import device_context

    ctx = device_context("cpu")
    for key in ("device", "device_name", "cpu_model", "threads", "framework_version", "bf16_supported", "timer"):
        assert key in ctx
    assert ctx["framework_version"] == torch.__version__ and ctx["threads"] == torch.get_num_threads()
