"""Trainer details that serving depends on."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from app.training.train import MODEL_FEATURES, predict, train_model  # noqa: E402


def test_constant_columns_are_not_scaled_by_rounding_noise() -> None:
    """The hardware columns of a single CPU never vary; another device's values must not explode."""
    rng = np.random.default_rng(0)
    n, f = 512, len(MODEL_FEATURES)
    x = rng.normal(size=(n, f)).astype(np.float32)
    col = MODEL_FEATURES.index("hw_log_op_peak_flops_per_s")
    x[:, col] = np.float32(26.53103)  # constant, not exactly representable: float32 std is ~1e-3, not 0
    y = rng.normal(size=n)
    m = train_model(x, y, epochs=1, seed=0, hidden=8, depth=1, batch_size=128, log=lambda s: None)
    assert float(m.std[col]) == 1.0
    other = x[:4].copy()
    other[:, col] += 1.5  # a different device
    out = predict(m, other)
    assert np.isfinite(out).all() and np.abs(out).max() < 50


def test_family_balance_gives_each_source_its_share_and_families_sqrt_rows() -> None:
    """``source_family``: sources keep equal shares; within one, a family with 4x the rows gets 2x the weight."""
    from app.training.train import loss_weights

    class Rows:
        def __init__(self, family: np.ndarray, source: np.ndarray) -> None:
            self.family, self.source = family, source

        def __len__(self) -> int:
            return len(self.family)

    family = np.array(["neusight:bmm"] * 400 + ["neusight:add"] * 100 + ["conv"] * 500)
    source = np.array(["neusight"] * 500 + ["justus2018"] * 500)
    data = Rows(family, source)
    w = loss_weights(data, "source_family")  # type: ignore[arg-type]
    assert w.mean() == pytest.approx(1.0)
    assert w[:500].sum() == pytest.approx(w[500:].sum())  # each source half the loss
    assert w[:400].sum() == pytest.approx(2 * w[400:500].sum())  # sqrt(400) : sqrt(100)
    assert np.allclose(loss_weights(data, "source")[:500], 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        loss_weights(data, "family")  # type: ignore[arg-type]


def test_member_reads_only_its_active_features_and_keeps_the_mask_through_weights(tmp_path) -> None:
    """A member trained with ``active`` ignores every other column (a mixed ensemble's device-blind member
    must not see the hardware figures), and the mask survives save/load of the weights."""
    from app.training.train import LATENCY_KINDS, Ensemble, KindHeads, load_weights, save_weights

    rng = np.random.default_rng(0)
    n, f = 512, len(MODEL_FEATURES)
    x = rng.normal(size=(n, f)).astype(np.float32)
    for kind in LATENCY_KINDS:  # the prior's latency term (SMs x clock) is physics, not the MLP
        x[:, MODEL_FEATURES.index(kind)] = 0.0
    y = rng.normal(size=n) + x[:, MODEL_FEATURES.index("hw_log_clock_mhz")]
    active = [name for name in MODEL_FEATURES if not name.startswith("hw_")]
    m = train_model(x, y, epochs=2, seed=0, hidden=8, depth=1, batch_size=128, active=active, log=lambda s: None)
    other = x[:8].copy()
    for name in MODEL_FEATURES:
        if name.startswith("hw_"):
            other[:, MODEL_FEATURES.index(name)] += 3.0
    assert np.allclose(predict(m, x[:8]), predict(m, other), atol=1e-6)
    full = train_model(x, y, epochs=2, seed=0, hidden=8, depth=1, batch_size=128, log=lambda s: None)
    assert not np.allclose(predict(full, x[:8]), predict(full, other), atol=1e-3)
    path = tmp_path / "w.npz"
    save_weights(KindHeads(Ensemble([m]), None), path)
    back = load_weights(path, feature_names=MODEL_FEATURES, hidden=8, depth=1).gpu_head.members[0]
    assert np.allclose(predict(back, other), predict(m, other), atol=1e-6)
    with pytest.raises(ValueError, match="not in feature_names"):
        train_model(x, y, epochs=1, seed=0, hidden=8, depth=1, active=["nope"], log=lambda s: None)


def _prior_rows(kind: str, sms: float, mhz: float, n: int = 3) -> np.ndarray:
    """Rows with the same floor (1 ms) and output elements on devices of ``sms`` SMs at ``mhz`` MHz."""
    x = np.zeros((n, len(MODEL_FEATURES)), dtype=np.float32)
    x[:, MODEL_FEATURES.index(kind)] = 1.0
    x[:, MODEL_FEATURES.index("log_floor_ms")] = 0.0  # ln 1 ms
    x[:, MODEL_FEATURES.index("log_out_elems")] = np.log(1e9)
    x[:, MODEL_FEATURES.index("hw_log_compute_units")] = np.log(sms)
    x[:, MODEL_FEATURES.index("hw_log_clock_mhz")] = np.log(mhz)
    return x


def test_latency_prior_scales_gathers_with_sms_and_clock_not_with_the_floor() -> None:
    """An embedding's prior is its SM-cycle term: 1e9 elements at c cycles per element on 100 SMs x 1 GHz is
    10·c ms over a 1 ms floor; half the SM cycles per second doubles it at the same floor. A GEMM has no such
    term: its prior is 1/efficiency + overhead whatever the SMs."""
    from app.training.train import LATENCY_KINDS, LayerTimeNet

    f = len(MODEL_FEATURES)
    m = LayerTimeNet(np.zeros(f), np.ones(f))
    with torch.no_grad():
        fast = m.prior(torch.tensor(_prior_rows("is_embedding", 100, 1000))).numpy()
        slow = m.prior(torch.tensor(_prior_rows("is_embedding", 50, 1000))).numpy()
        gemm = m.prior(torch.tensor(_prior_rows("is_gemm", 100, 1000))).numpy()
        gemm_slow = m.prior(torch.tensor(_prior_rows("is_gemm", 50, 1000))).numpy()
    cycles = LATENCY_KINDS["is_embedding"]
    assert np.exp(fast) == pytest.approx(cycles * 1e9 / (100 * 1e9) * 1e3, rel=0.05)  # ms over a 1 ms floor
    assert np.exp(slow - fast) == pytest.approx(2.0, rel=0.05)
    assert np.allclose(gemm, gemm_slow) and np.exp(gemm).max() < 3  # 1/efficiency + overhead only


def test_latency_prior_of_element_wise_ops_and_norms_scales_with_their_flops() -> None:
    """Element-wise ops and norms pay ``cycles x FLOPs / (SMs x clock)`` on top of ``floor / memory efficiency``:
    at the same floor and output elements, 6 FLOPs per element (SiLU-and-mul) cost 6x the term of 1 (add), and
    half the SMs double it. Initial constants: 1e9 FLOPs x 0.07 cycles on 100 SMs x 1 GHz = 0.7 ms over a 1 ms
    floor at 0.9 memory efficiency."""
    from app.training.train import LATENCY_KINDS, MEMORY_EFFICIENCY, LayerTimeNet

    f = len(MODEL_FEATURES)
    m = LayerTimeNet(np.zeros(f), np.ones(f))
    flops = MODEL_FEATURES.index("log_flops")
    for kind in ("is_elementwise", "is_norm"):
        add, silu, half = (_prior_rows(kind, sms, 1000) for sms in (100, 100, 50))
        add[:, flops], silu[:, flops], half[:, flops] = np.log(1e9), np.log(6e9), np.log(1e9)
        with torch.no_grad():
            p_add, p_silu, p_half = (np.exp(m.prior(torch.tensor(x)).numpy()) for x in (add, silu, half))
        ovh = math.exp(m.ln_ovh.item())  # the per-launch overhead, ms over the 1 ms floor
        mem = 1 / MEMORY_EFFICIENCY + ovh
        term = LATENCY_KINDS[kind] * 1e9 / (100 * 1e9) * 1e3
        assert p_add == pytest.approx(mem + term, rel=1e-4)
        assert p_silu - mem == pytest.approx(6 * term, rel=1e-4) and p_half - mem == pytest.approx(2 * term, rel=1e-4)


def test_a_gathers_latency_overlaps_its_dram_time_an_element_wise_ops_adds_to_it() -> None:
    """With the SM-cycle term equal to floor / memory efficiency, a gather (LATENCY_OVERLAP_P 4) takes 2^(1/4)
    of it and an element-wise op (1: a sum) twice it, plus the per-launch overhead in both (PyTorch eager)."""
    from app.training.train import LATENCY_KINDS, LATENCY_OVERLAP_P, MEMORY_EFFICIENCY, LayerTimeNet

    f = len(MODEL_FEATURES)
    m = LayerTimeNet(np.zeros(f), np.ones(f))
    mem = 1 / MEMORY_EFFICIENCY  # ms over the 1 ms floor
    ovh = math.exp(m.ln_ovh.item())
    for kind, column in (("is_embedding", "log_out_elems"), ("is_elementwise", "log_flops")):
        x = _prior_rows(kind, 100, 1000)
        x[:, MODEL_FEATURES.index(column)] = np.log(mem * 1e-3 * 100 * 1e9 / LATENCY_KINDS[kind])  # term = mem
        with torch.no_grad():
            got = np.exp(m.prior(torch.tensor(x)).numpy())
        p = LATENCY_OVERLAP_P[kind]
        assert got == pytest.approx(2 ** (1 / p) * mem + ovh, rel=1e-4)
    assert LATENCY_OVERLAP_P["is_embedding"] > 1 and LATENCY_OVERLAP_P["is_elementwise"] == 1


def test_kernel_time_overlaps_the_per_launch_overhead_with_the_work() -> None:
    """Launch-gap timing adds the per-launch overhead to the work; summed kernel durations (Vidur) take the
    smooth maximum: a GEMM at the initial efficiency 0.5 whose floor equals the initial overhead (10 us) is
    2 + 1 floors under PyTorch eager and (2^p + 1)^(1/p) under kernel time."""
    from app.training.train import KERNEL_TIME_OVERHEAD_P, LayerTimeNet

    f = len(MODEL_FEATURES)
    m = LayerTimeNet(np.zeros(f), np.ones(f))
    eager = _prior_rows("is_gemm", 100, 1000)
    eager[:, MODEL_FEATURES.index("log_floor_ms")] = math.log(0.01)
    kernel = eager.copy()
    kernel[:, MODEL_FEATURES.index("stack_kernel_time")] = 1.0
    with torch.no_grad():
        p_eager, p_kernel = (np.exp(m.prior(torch.tensor(x)).numpy()) for x in (eager, kernel))
    p = KERNEL_TIME_OVERHEAD_P
    assert p_eager == pytest.approx(3.0, rel=1e-4)
    assert p_kernel == pytest.approx((2.0**p + 1.0) ** (1 / p), rel=1e-4) and p > 1


def test_weights_without_the_latency_term_load_and_keep_their_prior(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model saved without the latency term (v3 artifacts) loads without it, so its function is unchanged."""
    from app.training.train import Ensemble, KindHeads, LayerTimeNet, load_weights, save_weights

    f = len(MODEL_FEATURES)
    old = LayerTimeNet(np.zeros(f), np.ones(f), hidden=8, depth=1, latency_prior=False)
    path = tmp_path / "w.npz"
    save_weights(KindHeads(Ensemble([old]), None), path)
    loaded = load_weights(path, feature_names=MODEL_FEATURES, hidden=8, depth=1).gpu_head.members[0]
    x = torch.tensor(_prior_rows("is_embedding", 100, 1000))
    with torch.no_grad():
        assert not loaded.cycle_cols
        assert torch.allclose(loaded(x), old(x))
        assert torch.allclose(loaded.prior(x), old.prior(x))
    gather_only = LayerTimeNet(np.zeros(f), np.ones(f), hidden=8, depth=1, latency_kinds=("is_embedding",))
    save_weights(KindHeads(Ensemble([gather_only]), None), path)  # layer-time-mlp-4: the term for gathers only
    loaded = load_weights(path, feature_names=MODEL_FEATURES, hidden=8, depth=1).gpu_head.members[0]
    ew = torch.tensor(_prior_rows("is_elementwise", 100, 1000))
    with torch.no_grad():
        assert loaded.latency_kinds == ("is_embedding",) and torch.allclose(loaded(ew), gather_only(ew))
    new = LayerTimeNet(np.zeros(f), np.ones(f), hidden=8, depth=1)
    save_weights(KindHeads(Ensemble([new]), None), path)
    again = load_weights(path, feature_names=MODEL_FEATURES, hidden=8, depth=1).gpu_head.members[0]
    with torch.no_grad():
        assert again.cycle_cols and torch.allclose(again(x), new(x))
