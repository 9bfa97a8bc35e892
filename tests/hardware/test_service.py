"""Hardware service on a real (SQLite) database: seeding, custom entries, errors."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.auth import Principal, Scope
from app.errors import ConflictingHardware, HardwareExists, HardwareNotFound
from app.hardware import service
from app.hardware.catalog import load_catalog
from app.hardware.models import Hardware
from app.hardware.schemas import HardwareCreate

CUSTOM: dict[str, Any] = {
    "id": "my-gpu",
    "name": "My GPU",
    "vendor": "Acme",
    "kind": "gpu",
    "peak_flops_per_s": {"fp32": 50e12, "fp16": 200e12},
    "memory_bytes": 32 * 2**30,
    "memory_bandwidth_bytes_per_s": 1.5e12,
    "compute_units": 100,
    "boost_clock_mhz": 1800,
    "l2_cache_bytes": 40 * 2**20,
    "sources": {"peak_flops_per_s.fp32": "Acme datasheet"},
}


def _count(db: Session) -> int:
    return db.scalar(select(func.count()).select_from(Hardware)) or 0


def test_seed_inserts_catalog_and_local_and_is_idempotent(db: Session) -> None:
    inserted = service.seed_builtin(db)
    assert inserted == len(load_catalog()) + 1
    assert _count(db) == inserted
    assert service.seed_builtin(db) == 0
    assert _count(db) == inserted
    local = db.get(Hardware, "local")
    assert local is not None and local.builtin and local.kind == "cpu"
    assert service.get_spec(db, hardware_id="v100-sxm2-16gb") == load_catalog()["v100-sxm2-16gb"]


def test_seed_refreshes_a_changed_builtin_row(db: Session) -> None:
    service.seed_builtin(db, include_local=False)
    row = db.get(Hardware, "t4")
    assert row is not None
    row.spec = {**row.spec, "name": "stale"}
    db.flush()
    assert service.seed_builtin(db, include_local=False) == 1
    assert service.get_spec(db, hardware_id="t4").name == "NVIDIA T4"


def test_create_custom_adds_a_row(db: Session) -> None:
    read = service.create_custom(db, data=HardwareCreate(**CUSTOM))
    assert read.id == "my-gpu" and read.builtin is False
    spec = service.get_spec(db, hardware_id="my-gpu")
    assert spec.peak_flops_per_s == {"fp32": 50e12, "fp16": 200e12}
    assert spec.memory_bandwidth_bytes_per_s == 1.5e12
    row = db.get(Hardware, "my-gpu")
    assert row is not None and row.peak_fp32_flops_per_s == 50e12 and row.compute_units == 100


def test_duplicate_raises_and_keeps_the_stored_row(db: Session) -> None:
    service.create_custom(db, data=HardwareCreate(**CUSTOM))
    before = dict(db.get(Hardware, "my-gpu").spec)  # type: ignore[union-attr]
    with pytest.raises(HardwareExists) as info:
        service.create_custom(db, data=HardwareCreate(**{**CUSTOM, "name": "Other", "compute_units": 1}))
    assert info.value.status_code == 409 and info.value.detail == {"hardware_id": "my-gpu"}
    db.expire_all()
    assert db.get(Hardware, "my-gpu").spec == before  # type: ignore[union-attr]
    assert _count(db) == 1


@pytest.mark.parametrize("hardware_id", ["a100-sxm4-40gb", "local"])
def test_builtin_ids_are_reserved_even_before_seeding(db: Session, hardware_id: str) -> None:
    with pytest.raises(HardwareExists):
        service.create_custom(db, data=HardwareCreate(**{**CUSTOM, "id": hardware_id}))
    assert _count(db) == 0


def test_seed_never_overwrites_a_custom_row(db: Session) -> None:
    custom = {**CUSTOM, "id": "t4"}
    db.add(Hardware(id="t4", name="mine", kind="gpu", builtin=False, spec=custom, peak_fp32_flops_per_s=1.0,
                    memory_bandwidth_bytes_per_s=1.0, compute_units=1))  # fmt: skip
    db.flush()
    service.seed_builtin(db, include_local=False)
    assert service.get_spec(db, hardware_id="t4").name == "My GPU"


def test_get_spec_reads_the_row_as_it_is_now(db: Session) -> None:
    """get_spec reads the spec column each time (no cache that another worker's update could leave stale): an
    update, an edit not yet flushed (autoflush) and a delete are each seen by the next call."""
    admin = Principal(None, frozenset({Scope.ADMIN}))
    service.create_custom(db, data=HardwareCreate(**CUSTOM))
    assert service.get_spec(db, hardware_id="my-gpu").memory_bandwidth_bytes_per_s == 1.5e12
    faster = HardwareCreate(**{**CUSTOM, "memory_bandwidth_bytes_per_s": 2e12})
    service.update_custom(db, hardware_id="my-gpu", data=faster, principal=admin)
    assert service.get_spec(db, hardware_id="my-gpu").memory_bandwidth_bytes_per_s == 2e12
    row = db.get(Hardware, "my-gpu")
    assert row is not None
    row.spec = {**row.spec, "name": "Renamed"}  # not flushed
    assert service.get_spec(db, hardware_id="my-gpu").name == "Renamed"
    service.delete_custom(db, hardware_id="my-gpu", principal=admin)
    with pytest.raises(HardwareNotFound):
        service.get_spec(db, hardware_id="my-gpu")


def test_get_unknown_raises_not_found(db: Session) -> None:
    with pytest.raises(HardwareNotFound) as info:
        service.get_spec(db, hardware_id="nope")
    assert info.value.status_code == 404 and info.value.detail == {"hardware_id": "nope"}
    with pytest.raises(HardwareNotFound):
        service.get_hardware(db, hardware_id="nope")


def test_list_filters_by_kind_builtin_first(db: Session) -> None:
    service.seed_builtin(db)
    service.create_custom(db, data=HardwareCreate(**{**CUSTOM, "id": "000-custom"}))
    listed = service.list_hardware(db)
    assert listed.count == len(listed.items) == len(load_catalog()) + 2
    assert listed.items[-1].id == "000-custom" and not listed.items[-1].builtin
    cpus = service.list_hardware(db, kind="cpu")
    assert [item.id for item in cpus.items] == ["local"]


def test_spec_from_inline_builds_without_storing(db: Session) -> None:
    spec = service.spec_from_inline(HardwareCreate(**CUSTOM))
    assert spec.id == "my-gpu" and spec.peak_for("bf16") == 50e12
    assert _count(db) == 0


def test_resolve_inline_is_the_stored_device_or_a_conflict(db: Session) -> None:
    service.seed_builtin(db, include_local=False)
    a100 = load_catalog()["a100-sxm4-80gb"]
    required = {"id": a100.id, "name": a100.name, "vendor": a100.vendor, "kind": a100.kind,
                "peak_flops_per_s": dict(a100.peak_flops_per_s), "memory_bytes": a100.memory_bytes,
                "memory_bandwidth_bytes_per_s": a100.memory_bandwidth_bytes_per_s,
                "compute_units": a100.compute_units, "boost_clock_mhz": a100.boost_clock_mhz,
                "l2_cache_bytes": a100.l2_cache_bytes}
    # the fields left out are the stored device's, its sources included
    assert service.resolve_inline(db, data=HardwareCreate(**required)) == (a100, None)
    with pytest.raises(ConflictingHardware) as caught:  # an explicit null is a value too
        service.resolve_inline(db, data=HardwareCreate(**{**required, "tdp_w": None,
                                                          "peak_flops_per_s": {"fp32": a100.peak_for("fp32")}}))
    assert caught.value.detail == {"hardware_id": a100.id, "fields": ["peak_flops_per_s", "tdp_w"]}
    custom, _ = service.resolve_inline(db, data=HardwareCreate(**{**CUSTOM, "price_usd_per_hour": 2.0}))
    assert custom.sources == {**CUSTOM["sources"], "price_usd_per_hour": service.INLINE_PRICE_SOURCE}
    assert service.resolve_inline(db, data=HardwareCreate(**CUSTOM))[0].sources == CUSTOM["sources"]
    assert _count(db) == len(load_catalog())  # nothing stored


def test_a_gpu_without_clock_or_l2_is_refused_not_guessed() -> None:
    """The learned predictor reads the clock and the L2 size: without them a GPU would be featurised far outside
    the training range (a custom H100 without L2 came out 10x slower), so the spec is refused with the fields named."""
    for drop, named in (("boost_clock_mhz", "boost_clock_mhz or base_clock_mhz"), ("l2_cache_bytes", "l2_cache_bytes")):
        body = {k: v for k, v in CUSTOM.items() if k != drop}
        with pytest.raises(ValueError, match=named):
            HardwareCreate(**body)
    assert HardwareCreate(**{**CUSTOM, "boost_clock_mhz": None, "base_clock_mhz": 1200}).base_clock_mhz == 1200
    cpu = {k: v for k, v in CUSTOM.items() if k not in ("boost_clock_mhz", "l2_cache_bytes")}
    assert HardwareCreate(**{**cpu, "kind": "cpu"}).kind == "cpu"
