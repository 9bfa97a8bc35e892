"""Catalog fields for data parallel and money: every GPU has a sourced interconnect; prices are sourced list
prices."""

from __future__ import annotations

import re

import pytest

from app.hardware.catalog import InvalidHardwareSpec, load_catalog, parse_catalog


def test_every_gpu_has_a_sourced_interconnect() -> None:
    gpus = [s for s in load_catalog().values() if s.kind == "gpu"]
    assert len(gpus) >= 20
    for spec in gpus:
        link = spec.link()
        assert link is not None, spec.id
        assert 10e9 <= link.bandwidth_bytes_per_s <= 1000e9 and 1e-7 < link.step_latency_s < 1e-4
        assert "interconnect_bandwidth_bytes_per_s" in spec.sources and "interconnect_latency_s" in spec.sources
    kinds = {s.id: s.interconnect for s in gpus}
    assert kinds["a100-sxm4-80gb"] == kinds["h100-sxm"] == "nvlink"
    assert kinds["a100-pcie-80gb"] == kinds["t4"] == "pcie"
    # NVLink 4 is faster than NVLink 3 is faster than PCIe 4.0
    cat = load_catalog()
    bw = {k: cat[k].interconnect_bandwidth_bytes_per_s or 0 for k in ("h100-sxm", "a100-sxm4-80gb", "a100-pcie-80gb")}
    assert bw["h100-sxm"] > bw["a100-sxm4-80gb"] > bw["a100-pcie-80gb"]


def test_prices_are_dated_list_prices() -> None:
    priced = [s for s in load_catalog().values() if s.price_usd_per_hour is not None]
    assert {"a100-sxm4-80gb", "h100-sxm", "t4"} <= {s.id for s in priced}
    for spec in priced:
        src = spec.sources["price_usd_per_hour"]
        assert "list price" in src and re.search(r"\b20\d\d\b", src), spec.id  # an offer with its date
        # each says whether it was checked, against what, and when (issue 9: verified, or said it is not)
        assert ("Verified 2026-12-01" in src or "retrieved 2026-11-09" in src or "NOT verified" in src), spec.id


def test_half_a_link_is_rejected() -> None:
    entry = """[x]
name = "X"
vendor = "V"
kind = "gpu"
peak_tflops = { fp32 = 1.0 }
memory_gib = 1
memory_bandwidth_gb_per_s = 100
compute_units = 1
interconnect = "pcie"
[x.sources]
"peak_flops_per_s.fp32" = 'a'
memory_bytes = 'a'
memory_bandwidth_bytes_per_s = 'a'
compute_units = 'a'
"""
    with pytest.raises(InvalidHardwareSpec, match="go together"):
        parse_catalog(entry)


def test_hardware_api_shows_and_validates_the_new_fields(client) -> None:  # noqa: ANN001 - TestClient fixture
    body = client.get("/v1/hardware/a100-sxm4-80gb").json()
    assert body["interconnect"] == "nvlink"
    assert body["interconnect_bandwidth_bytes_per_s"] == 300e9 and body["interconnect_latency_s"] == 5.7e-6
    assert body["price_usd_per_hour"] == 3.4309 and "p4de.24xlarge" in body["sources"]["price_usd_per_hour"]
    custom = {"id": "half-link", "name": "Half", "vendor": "X", "peak_flops_per_s": {"fp32": 1e12},
              "memory_bytes": 2**30, "memory_bandwidth_bytes_per_s": 1e11, "compute_units": 1,
              "interconnect": "pcie"}
    r = client.post("/v1/hardware", json=custom)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    r = client.post("/v1/hardware", json={**custom, "interconnect_bandwidth_bytes_per_s": 31.5e9,
                                          "interconnect_latency_s": 5.7e-6, "tdp_w": 100, "idle_power_w": 150})
    assert r.status_code == 422
