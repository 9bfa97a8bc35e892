"""Hardware catalog use cases: seed the built-in entries, read, list, add custom devices.

Keyword-only arguments after the session; functions ``flush()`` and never ``commit()`` (the request or
the caller owns the transaction, STYLE.md §3). Errors are :mod:`app.errors` domain errors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.auth import Principal, check_owner
from app.core.hardware import HardwareSpec
from app.db import DATABASE_DOWN, database_is_down
from app.errors import (
    BuiltinHardware,
    ConflictingHardware,
    HardwareExists,
    HardwareInUse,
    HardwareNotFound,
    InvalidRequest,
)
from app.hardware.catalog import (
    InvalidHardwareSpec,
    load_catalog,
    spec_from_dict,
    spec_to_dict,
    validate_spec,
)
from app.hardware.local import LOCAL_ID, local_cpu_spec
from app.hardware.models import Hardware
from app.hardware.repository import HardwareRepository
from app.hardware.schemas import HardwareCreate, HardwareList, HardwareRead

logger = logging.getLogger(__name__)


def _columns(spec: HardwareSpec) -> dict[str, Any]:
    """Column values of the ``hardware`` row that stores ``spec``."""
    return {
        "name": spec.name,
        "kind": spec.kind,
        "spec": spec_to_dict(spec),
        "peak_fp32_flops_per_s": float(spec.peak_flops_per_s["fp32"]),
        "memory_bandwidth_bytes_per_s": float(spec.memory_bandwidth_bytes_per_s),
        "compute_units": int(spec.compute_units),
    }


def _to_read(row: Hardware) -> HardwareRead:
    return HardwareRead(**row.spec, builtin=row.builtin, owner=row.owner)


def builtin_ids() -> set[str]:
    """Ids reserved for built-in entries: the datasheet catalog and ``local``."""
    return set(load_catalog()) | {LOCAL_ID}


def seed_builtin(session: Session, *, include_local: bool = True) -> int:
    """Insert or refresh the built-in entries (``builtin=True``): every catalog entry and, when
    ``include_local``, this machine's CPU as ``local``. Its memory bandwidth is measured (~0.5 s) only
    when the stored ``local`` row was not measured on this same machine
    (:func:`app.hardware.local.local_cpu_spec`); otherwise the stored measurement is kept, so
    predictions on ``local`` survive restarts unchanged. If detection fails, ``local`` is skipped and
    the error logged.

    Idempotent: a second call changes nothing unless the catalog file or the local machine changed.
    A stored *custom* row whose id collides with a built-in id is left untouched (logged). Flushes,
    does not commit. Returns the number of rows inserted or updated.
    """
    repo = HardwareRepository(session)
    specs = list(load_catalog().values())
    if include_local:
        try:
            specs.append(validate_spec(local_cpu_spec(_stored_local(repo))))
        except Exception:  # a failed detection must not stop the service from starting
            logger.exception("local CPU detection failed; 'local' is not seeded")
    changed = 0
    for spec in specs:
        values = _columns(spec)
        row = repo.get(spec.id)
        if row is None:
            repo.add(Hardware(id=spec.id, builtin=True, **values))
            changed += 1
        elif not row.builtin:
            logger.warning("custom hardware %r shadows a built-in entry; kept as stored", spec.id)
        elif any(getattr(row, key) != value for key, value in values.items()):
            for key, value in values.items():
                setattr(row, key, value)
            changed += 1
    repo.flush()
    return changed


def register_measured(session: Session, *, spec: HardwareSpec) -> bool:
    """Store ``spec``, the machine that measured imported rows (the profiler's ``hardware.json``), as a
    device of its own (``builtin=False``, no owner), so its rows are featurised with *its* bandwidth and
    peaks, never with those of the machine that imports them.

    Returns True when inserted, False when the same spec (every field but ``sources``) is stored already.
    Raises :class:`app.errors.HardwareExists` (409) when ``spec.id`` is a built-in id or is stored with
    another spec: the rows stored against it would change meaning. Raises
    :class:`app.errors.InvalidRequest` (422) for an invalid spec. Flushes.
    """
    try:
        spec = validate_spec(spec)
    except InvalidHardwareSpec as exc:
        raise InvalidRequest(str(exc), detail={"hardware_id": spec.id}) from exc
    repo = HardwareRepository(session)
    if spec.id in builtin_ids():
        raise HardwareExists(f"{spec.id!r} is a built-in id; the measuring machine needs an id of its own",
                             detail={"hardware_id": spec.id})
    row = repo.get(spec.id)
    if row is None:
        repo.add(Hardware(id=spec.id, builtin=False, owner=None, **_columns(spec)))
        repo.flush()
        return True
    stored = {k: v for k, v in row.spec.items() if k != "sources"}
    if stored != {k: v for k, v in spec_to_dict(spec).items() if k != "sources"}:
        raise HardwareExists(
            f"hardware {spec.id!r} is stored with another spec; import under another id (--hardware-spec with a "
            "new id) or compare the stored spec (GET /v1/hardware/{id})", detail={"hardware_id": spec.id})
    return False


def _stored_local(repo: HardwareRepository) -> HardwareSpec | None:
    """The built-in ``local`` spec stored at an earlier start, if any and readable."""
    row = repo.get(LOCAL_ID)
    if row is None or not row.builtin:
        return None
    try:
        return spec_from_dict(row.spec)
    except InvalidHardwareSpec:
        logger.warning("stored 'local' hardware spec is unreadable; measuring again")
        return None


def get_specs(session: Session, *, hardware_ids: set[str]) -> dict[str, HardwareSpec]:
    """The stored specs of those of ``hardware_ids`` that exist, by id, in one query (:func:`get_spec` of
    each, without a query per id; an unknown id is absent, for :func:`get_spec` to refuse)."""
    return {row.id: spec_from_dict(row.spec) for row in HardwareRepository(session).get_many(hardware_ids)}


def get_spec(session: Session, *, hardware_id: str) -> HardwareSpec:
    """The stored spec of ``hardware_id`` (units as in :class:`HardwareSpec`).

    Raises :class:`app.errors.HardwareNotFound` (404, detail ``{"hardware_id": ...}``).
    """
    spec = HardwareRepository(session).spec(hardware_id)
    if spec is None:
        raise HardwareNotFound(f"unknown hardware id {hardware_id!r}", detail={"hardware_id": hardware_id})
    return spec_from_dict(spec)


def get_hardware(session: Session, *, hardware_id: str) -> HardwareRead:
    """One stored device as the API shows it. Raises :class:`app.errors.HardwareNotFound` (404)."""
    row = HardwareRepository(session).get(hardware_id)
    if row is None:
        raise HardwareNotFound(f"unknown hardware id {hardware_id!r}", detail={"hardware_id": hardware_id})
    return _to_read(row)


def list_hardware(session: Session, *, kind: str | None = None) -> HardwareList:
    """All stored devices (only ``kind`` = ``gpu``/``cpu`` when given): built-in first, then by id."""
    items = [_to_read(row) for row in HardwareRepository(session).list(kind=kind)]
    return HardwareList(items=items, count=len(items))


def spec_from_inline(data: HardwareCreate) -> HardwareSpec:
    """A :class:`HardwareSpec` from a validated request body (a custom device or an inline spec in a
    prediction request); nothing is stored. Raises :class:`app.errors.InvalidRequest` (422) if the
    spec fails :func:`app.hardware.catalog.validate_spec`."""
    try:
        return validate_spec(HardwareSpec(**data.model_dump()))
    except InvalidHardwareSpec as exc:
        raise InvalidRequest(str(exc), detail={"hardware_id": data.id}) from exc


#: ``sources["price_usd_per_hour"]`` of an inline spec under an id nothing stores: the answer's ``price_source``.
INLINE_PRICE_SOURCE = "request.hardware"


def resolve_inline(session: Session, *, data: HardwareCreate) -> tuple[HardwareSpec, str | None]:
    """The device an inline spec of a prediction request stands for, and a warning when its id could not be
    checked; nothing is stored.

    Under an id that names a stored device (catalog, ``local`` or custom) it is that device, as stored (its
    ``sources`` and the fields the inline spec leaves out included): every field the inline spec gives but
    ``sources`` must equal the stored value, else :class:`app.errors.ConflictingHardware` (422
    ``conflicting_hardware``, ``detail.fields``: the differing names). Under any other id it is
    :func:`spec_from_inline` of it, its price (if given) sourced :data:`INLINE_PRICE_SOURCE`.

    While the database is down (:func:`app.db.database_is_down`) inline predictions keep working: a catalog id
    is checked against the built-in catalog, any other id is taken as given and the warning says it was not
    checked. Raises :class:`app.errors.InvalidRequest` (422) for an invalid spec.
    """
    warning = None
    try:
        stored = HardwareRepository(session).spec(data.id)
    except DATABASE_DOWN as exc:
        if not database_is_down(exc):
            raise
        catalog = load_catalog().get(data.id)
        stored = spec_to_dict(catalog) if catalog is not None else None
        if stored is None:
            warning = (f"the database is unavailable: inline hardware {data.id!r} was not checked against the "
                       "stored devices and is costed as given")
    if stored is None:
        spec = spec_from_inline(data)
        if spec.price_usd_per_hour is not None:
            spec = dataclasses.replace(spec, sources={**spec.sources, "price_usd_per_hour": INLINE_PRICE_SOURCE})
        return spec, warning
    spec = spec_from_dict(stored)
    current = spec_to_dict(spec)
    given = data.model_dump(exclude_unset=True, exclude={"sources"})
    differing = sorted(name for name, value in given.items() if value != current.get(name))
    if differing:
        raise ConflictingHardware(
            f"inline hardware {data.id!r} differs from the stored device of that id in {', '.join(differing)}: "
            "give hardware_id alone for the stored device, or the inline spec under an id of its own",
            detail={"hardware_id": data.id, "fields": differing})
    return spec, None


def create_custom(session: Session, *, data: HardwareCreate, owner: str | None = None) -> HardwareRead:
    """Store a custom device (``builtin=False``, owned by the API key id ``owner``) and return it.

    Never overwrites: raises :class:`app.errors.HardwareExists` (409, detail ``{"hardware_id": ...}``)
    if the id is stored already or is reserved for a built-in entry (catalog id or ``local``), even
    one not seeded yet. Raises :class:`app.errors.InvalidRequest` (422) for an invalid spec. Flushes.
    """
    spec = spec_from_inline(data)
    repo = HardwareRepository(session)
    exists = HardwareExists(
        f"hardware {spec.id!r} already exists; choose another id", detail={"hardware_id": spec.id}
    )
    if spec.id in builtin_ids() or repo.get(spec.id) is not None:
        raise exists
    row = Hardware(id=spec.id, builtin=False, owner=owner, **_columns(spec))
    try:
        with session.begin_nested():  # savepoint: a concurrent insert must not spoil the transaction
            repo.add(row)
    except IntegrityError as exc:
        raise exists from exc
    return _to_read(row)


def _custom_row(session: Session, hardware_id: str, principal: Principal) -> Hardware:
    """The custom row ``hardware_id`` that ``principal`` may change, with no measurements on it."""
    repo = HardwareRepository(session)
    row = repo.get(hardware_id)
    if row is None:
        raise HardwareNotFound(f"unknown hardware id {hardware_id!r}", detail={"hardware_id": hardware_id})
    if row.builtin or hardware_id in builtin_ids():
        raise BuiltinHardware(f"{hardware_id!r} is a built-in catalog entry; it cannot be changed through the API",
                              detail={"hardware_id": hardware_id})
    check_owner(principal, row.owner, what="hardware", ident=hardware_id)
    count = repo.measurement_count(hardware_id)
    if count:
        raise HardwareInUse(
            f"{count} measurement(s) refer to {hardware_id!r}: changing its spec would change what they mean; "
            "add the corrected device under a new id",
            detail={"hardware_id": hardware_id, "measurements": count},
        )
    return row


def update_custom(session: Session, *, hardware_id: str, data: HardwareCreate, principal: Principal) -> HardwareRead:
    """Replace the spec of custom device ``hardware_id`` (``data.id`` must equal it) and return it.

    Raises :class:`HardwareNotFound` (404), :class:`BuiltinHardware` (403), :class:`app.auth.NotOwner`
    (403: another key added it), :class:`HardwareInUse` (409: measurements refer to it) and
    :class:`InvalidRequest` (422: a different ``id`` in the body, an invalid spec). Flushes.
    """
    if data.id != hardware_id:
        raise InvalidRequest(f"the body's id {data.id!r} differs from the path's {hardware_id!r}",
                             detail={"hardware_id": hardware_id, "body_id": data.id})
    row = _custom_row(session, hardware_id, principal)
    for key, value in _columns(spec_from_inline(data)).items():
        setattr(row, key, value)
    HardwareRepository(session).flush()
    return _to_read(row)


def delete_custom(session: Session, *, hardware_id: str, principal: Principal) -> None:
    """Delete custom device ``hardware_id``. Raises as :func:`update_custom` (but for the body). Flushes."""
    repo = HardwareRepository(session)
    repo.delete(_custom_row(session, hardware_id, principal))
