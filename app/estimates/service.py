"""Use cases of the callers' endpoints: batch predictions, job estimates and actuals, hardware comparisons.

Each call gathers its scenarios, predicts all their layers in one batched predictor call
(:mod:`app.estimates.engine`) and aggregates each with :func:`app.core.aggregate.aggregate`. A per-item
failure (unknown graph or device, a precision the device lacks, a graph that does not import) is answered
in that item with the code its own request would have had; it never fails the other items. Keyword-only
arguments after the session; functions flush and never commit (STYLE.md §3).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.core.aggregate import Aggregate, LayerSums
from app.core.precision import PRECISION_SEMANTICS, Precision
from app.core.vocab import Granularity, Pass, SoftwareStack
from app.errors import (
    BatchAxisInDims,
    DuplicateBatchSizes,
    InvalidActuals,
    InvalidRequest,
    LayercastError,
    TooManyItems,
    UnboundDimension,
    UnknownDimension,
)
from app.estimates import engine
from app.estimates.calibration import (
    MAX_ACTUAL_RATIO,
    UNCALIBRATED,
    Calibration,
    CalibrationGroup,
    RatioStats,
    calibrate_stats,
)
from app.estimates.engine import GraphCache, Scenario
from app.estimates.schemas import (
    MAX_BATCH_ITEMS,
    MAX_JOBS,
    BatchItem,
    BatchItemRead,
    BatchPredictionCreate,
    BatchPredictionRead,
    BatchSummary,
    BatchSweep,
    CalibrationGroupRead,
    ComparisonCreate,
    ComparisonRead,
    ComparisonRow,
    ItemError,
    JobActual,
    JobActualRead,
    JobActualsCreate,
    JobActualsRead,
    JobEstimateRead,
    JobEstimatesCreate,
    JobEstimatesRead,
    JobSpec,
    SweepRow,
    Unavailable,
)
from app.graphs import service as graphs
from app.graphs.repository import GraphRepository
from app.hardware import service as hardware_service
from app.measurements.importers import MeasurementRecord
from app.measurements.models import Measurement, MeasurementBatch, PredictorVersion
from app.measurements.repository import MeasurementRepository
from app.measurements.service import (
    ACTUALS_SOURCE,  # source of POST /v1/job-estimates/actuals rows
    claim_batch,
    idempotent_request,
    stored_batch,
)
from app.measurements.validation import RowProblem, field_problems
from app.predictions.schemas import PredictionCreate, RunSettings
from app.predictions.service import (
    answer_warnings,
    check_costed,
    estimate,
    loss_ms,
    memory_warning,
    network_warning,
    unsupported_warning,
)
from app.predictor.base import Predictor
from app.predictor.metadata import JobCalibrationFit, RatioStatsModel
from app.predictor.table import Estimates

T = TypeVar("T")


def _limit(items: Sequence[Any], limit: int, what: str) -> None:
    if len(items) > limit:
        raise TooManyItems(f"{len(items)} {what} exceed the limit of {limit} per call; split them",
                           detail={"count": len(items), "limit": limit})


def _attempt(fn: Callable[[], T], *, raising: tuple[type[LayercastError], ...] = ()) -> T | ItemError:
    """``fn()``, or the :class:`ItemError` of the domain error (or request validation error) it raised; the
    errors of ``raising`` are raised, not answered in the item."""
    try:
        return fn()
    except raising:
        raise
    except LayercastError as exc:
        return ItemError(code=exc.code, message=exc.message, detail=exc.detail)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        return ItemError(code="validation_error", message=str(first.get("msg", exc)))


# ------------------------------------------------------------------------------------- batch predictions


def _item_request(item: BatchItem) -> PredictionCreate:
    return PredictionCreate(
        graph_id=item.graph_id, graph=item.graph, hardware_id=item.hardware_id, batch_size=item.batch_size,
        mode=item.mode, optimizer=item.optimizer, precision=item.precision, software_stack=item.software_stack,
        dims=item.dims)


def _summary(cache: GraphCache, s: Scenario, agg: Aggregate, estimates: Estimates) -> BatchSummary:
    it = agg.iteration
    fp = cache.footprint(s)
    warnings = answer_warnings(s.analysis, s.hardware, s.request, estimates=estimates, agg=agg, fp=fp,
                               loss=loss_ms(s.bound, s.training, estimates))
    return BatchSummary(
        iteration_ms=it.time_ms, iteration_ms_p10=it.time_ms_p10, iteration_ms_p90=it.time_ms_p90,
        forward_ms=it.forward_ms, backward_ms=it.backward_ms, update_ms=it.update_ms,
        samples_per_s=it.samples_per_s, peak_memory_bytes=cache.footprint(s).total_bytes, fits=cache.fits(s),
        layers=s.analysis.layer_count, layers_unsupported=s.analysis.unsupported_layer_count, energy_j=it.energy_j,
        warnings=warnings,
    )


def predict_batch(session: Session, predictor: Predictor, *, request: BatchPredictionCreate) -> BatchPredictionRead:
    """Predict every item of ``request`` with one batched predictor call (module docstring).

    Raises :class:`TooManyItems` (413) beyond :data:`MAX_BATCH_ITEMS`; per-item errors are in the items.
    """
    _limit(request.items, MAX_BATCH_ITEMS, "items")
    cache = GraphCache(session, predictor)
    scenarios = [_attempt(partial(_costed_scenario, cache, _item_request(item))) for item in request.items]
    ok = [(i, s) for i, s in enumerate(scenarios) if isinstance(s, Scenario)]
    found = engine.predict_layers(cache, [s for _, s in ok])
    results: list[BatchItemRead] = [
        BatchItemRead(index=i, error=s) for i, s in enumerate(scenarios) if isinstance(s, ItemError)
    ]
    for (i, s), estimates, sums in zip(ok, found.estimates, found.sums, strict=True):

        def answer(i: int = i, s: Scenario = s, estimates: Estimates = estimates,
                   sums: LayerSums = sums) -> BatchItemRead:
            agg = engine.scenario_aggregate(cache, s, sums)
            read = BatchItemRead(index=i, summary=_summary(cache, s, agg, estimates))
            if request.detail == "layers":
                read.prediction = estimate(s.analysis, s.hardware, predictor, request=s.request,
                                           graph_id=s.request.graph_id, bound=s.bound, estimates=estimates)
            return read

        result = _attempt(answer)
        results.append(result if isinstance(result, BatchItemRead) else BatchItemRead(index=i, error=result))
    results.sort(key=lambda r: r.index)
    return BatchPredictionRead(
        predictor_version=predictor.version, count=len(results), failed=sum(r.error is not None for r in results),
        layer_queries=found.queries, unique_layer_queries=found.unique_queries, items=results,
    )


# ----------------------------------------------------------------------------------------- job estimates


def run_settings(source: RunSettings) -> dict[str, Any]:
    """The :class:`RunSettings` fields of ``source``, for the schema a job or comparison row is predicted as."""
    return {name: getattr(source, name) for name in RunSettings.model_fields}


def _job_request(job: JobSpec, **extra: Any) -> PredictionCreate:
    """The single prediction a job is; raises ``ValidationError`` (a batch that does not divide over the
    devices)."""
    return PredictionCreate(
        graph_id=job.graph_id, hardware_id=job.hardware_id, device_count=job.device_count, nodes=job.nodes,
        inter_node_bandwidth_bytes_per_s=job.inter_node_bandwidth_bytes_per_s,
        inter_node_latency_s=job.inter_node_latency_s, batch_size=job.batch_size,
        dataset_size=job.dataset_size, epochs=job.epochs, precision=job.precision, optimizer=job.optimizer,
        software_stack=job.software_stack, dims=job.dims,
        **run_settings(job), **extra)


def _job_scenario(cache: GraphCache, job: JobSpec, **extra: Any) -> Scenario:
    """The bound scenario of ``job`` (:func:`_costed_scenario`)."""
    return _costed_scenario(cache, _job_request(job, **extra))


def _costed_scenario(cache: GraphCache, request: PredictionCreate) -> Scenario:
    """The bound scenario of ``request`` (:meth:`GraphCache.scenario`, with its errors); raises
    :class:`app.errors.NoCostedLayers` (422 ``no_costed_layers``, :func:`check_costed`) when no layer of the graph
    has a cost formula, as ``POST /v1/predictions`` does."""
    s = cache.scenario(request)
    check_costed(s.analysis, request.graph_id)
    return s


@dataclass(frozen=True, slots=True)
class _JobModel:
    """The model's (uncalibrated) answer for one job."""

    p50_s: float
    p90_s: float
    fits: bool
    memory_warning: str | None = None  # the peak over the device's memory, when it does not fit
    warnings: tuple[str, ...] = ()  # an assumed network, uncosted layers (network_warning, unsupported_warning)


def _model_jobs(session: Session, predictor: Predictor, jobs: Sequence[JobSpec]) -> list[_JobModel | ItemError]:
    """Uncalibrated job time of every job, all layers predicted in one call."""
    cache = GraphCache(session, predictor)
    cache.preload_hardware({job.hardware_id for job in jobs})
    scenarios = [_attempt(partial(_job_scenario, cache, job)) for job in jobs]
    ok = [s for s in scenarios if isinstance(s, Scenario)]
    found = engine.predict_layers(cache, ok)
    sums_of = iter(found.sums)
    out: list[_JobModel | ItemError] = []
    for s in scenarios:
        if isinstance(s, ItemError):
            out.append(s)
            continue
        sums = next(sums_of)

        def model(s: Scenario = s, sums: LayerSums = sums) -> _JobModel:
            job = engine.scenario_aggregate(cache, s, sums).job
            assert job is not None
            said = (network_warning(s.request), unsupported_warning(s.analysis))
            return _JobModel(p50_s=job.time_s, p90_s=job.time_s_p90, fits=cache.fits(s),
                             memory_warning=memory_warning(cache.footprint(s), s.hardware),
                             warnings=tuple(w for w in said if w is not None))

        out.append(_attempt(model))
    return out


def _group(job: JobSpec) -> CalibrationGroup:
    """The calibration group of ``job``: its graph, hardware, precision, software stack, device count and nodes."""
    return CalibrationGroup(graph_id=job.graph_id, hardware_id=job.hardware_id, precision=job.precision.value,
                            software_stack=job.software_stack.value, device_count=job.device_count, nodes=job.nodes)


def _group_read(group: CalibrationGroup) -> CalibrationGroupRead:
    return CalibrationGroupRead(graph_id=group.graph_id, hardware_id=group.hardware_id,
                                precision=Precision(group.precision),
                                software_stack=SoftwareStack(group.software_stack),
                                device_count=group.device_count, nodes=group.nodes)


def _stored_fields(row: Measurement) -> dict[str, Any]:
    """The job fields of a stored actual (its config without what recording added). A row recorded before a
    field of the job existed lacks it: a missing ``device_count`` or ``nodes`` is :class:`JobSpec`'s default
    (1, what every job was before ``nodes`` existed), a missing ``precision`` or ``software_stack`` the
    precision or stack column of the row."""
    fields = {k: v for k, v in row.config.items() if k not in ("predicted_s", "predictor_version")}
    fields.setdefault("precision", row.precision)
    if row.software_stack is not None:
        fields.setdefault("software_stack", row.software_stack)
    return fields


def _stored_group(row: Measurement) -> CalibrationGroup | None:
    """The calibration group of a stored actual (:func:`_stored_fields`; its hardware from the row); None when
    its config does not name one (a malformed row: it calibrates nothing)."""
    cfg = _stored_fields(row)
    group = {"graph_id": cfg.get("graph_id"), "precision": cfg.get("precision"),
             "software_stack": cfg.get("software_stack", JobSpec.model_fields["software_stack"].default.value),
             "device_count": cfg.get("device_count", JobSpec.model_fields["device_count"].default),
             "nodes": cfg.get("nodes", JobSpec.model_fields["nodes"].default)}
    if not (isinstance(group["graph_id"], str) and isinstance(group["precision"], str)
            and isinstance(group["software_stack"], str)
            and type(group["device_count"]) is int and type(group["nodes"]) is int):
        return None
    return CalibrationGroup(hardware_id=row.hardware_id, **group)


def _fit_of(session: Session, predictor_version: str) -> JobCalibrationFit:
    """The whole-job calibration the retraining loop refit for ``predictor_version`` (empty when the version
    is not registered, e.g. a predictor a test injects, or predates the refit)."""
    row = session.get(PredictorVersion, predictor_version)
    if row is None:
        return JobCalibrationFit()
    return JobCalibrationFit.model_validate((row.metadata_ or {}).get("job_calibration") or {})


def _calibrations(
    session: Session, predictor_version: str, jobs: Sequence[JobSpec]
) -> dict[CalibrationGroup, Calibration]:
    """Calibration per :class:`CalibrationGroup` (graph, hardware, precision, stack, device count, nodes) of the jobs'
    devices: the version's refit (every actual up to its watermark, re-predicted by this version at retrain
    time) plus the actuals recorded after the watermark against this version (their ``predicted_s`` is this
    version's). Groups of a refit stored before groups had a setting (``"<graph>|<hardware>"``, every setting
    pooled) are not applied (:meth:`CalibrationGroup.from_key`)."""
    fit = _fit_of(session, predictor_version)
    hardware_ids = sorted({j.hardware_id for j in jobs})
    stats: dict[CalibrationGroup, RatioStats] = {}
    for key, g in fit.groups.items():
        group = CalibrationGroup.from_key(key)
        if group is not None and group.hardware_id in hardware_ids:
            stats[group] = RatioStats(g.n, g.total, g.total_sq)
    rows = MeasurementRepository(session).job_actuals(hardware_ids=hardware_ids, source=ACTUALS_SOURCE,
                                                      after_id=fit.watermark_measurement_id)  # fmt: skip
    ratios: dict[CalibrationGroup, list[float]] = {}
    for row in rows:
        cfg = row.config
        if cfg.get("predictor_version") != predictor_version:
            continue
        predicted_s = cfg.get("predicted_s")
        group = _stored_group(row)
        if group is not None and isinstance(predicted_s, int | float) and predicted_s > 0:
            ratios.setdefault(group, []).append(math.log(row.time_ms_median / 1e3 / predicted_s))
    for group, r in ratios.items():
        stats[group] = stats.get(group, RatioStats()).plus(RatioStats.of(r))
    return {group: calibrate_stats(st) for group, st in stats.items()}


def refit_job_calibration(session: Session, predictor: Predictor, *, up_to_id: int | None) -> JobCalibrationFit:
    """Re-predict every recorded job actual (source :data:`ACTUALS_SOURCE`, ids up to ``up_to_id``) with
    ``predictor`` and summarise ln(actual / prediction) per :class:`CalibrationGroup` (graph, hardware,
    precision, stack, device count, nodes; keyed by :attr:`CalibrationGroup.key`; a row without a field is read as
    :func:`_stored_fields` says): the whole-job calibration of a new version, refit by the retraining loop
    (:mod:`app.training.retrain`) so that actuals recorded against earlier versions keep calibrating it.
    Actuals whose job cannot be predicted any more (graph deleted, device gone) are counted in
    ``evaluation["skipped"]``.

    ``evaluation``: leave-one-out on the groups with at least two actuals, each actual estimated from the
    others of its group: MAPE (%) of the calibrated and of the uncalibrated p50, on the same actuals.
    """
    rows = MeasurementRepository(session).job_actuals(source=ACTUALS_SOURCE, up_to_id=up_to_id)
    specs: list[JobSpec] = []
    kept: list[Measurement] = []
    skipped = 0
    for row in rows:
        try:
            specs.append(JobSpec.model_validate(_stored_fields(row)))
        except ValidationError:
            skipped += 1
            continue
        kept.append(row)
    models = _model_jobs(session, predictor, specs)
    ratios: dict[str, list[tuple[float, float, float]]] = {}  # key -> (log ratio, actual s, predicted s)
    for row, spec, m in zip(kept, specs, models, strict=True):
        if isinstance(m, ItemError) or not m.p50_s > 0:
            skipped += 1
            continue
        actual_s = row.time_ms_median / 1e3
        ratios.setdefault(_group(spec).key, []).append((math.log(actual_s / m.p50_s), actual_s, m.p50_s))
    groups = {key: RatioStats.of([r for r, _, _ in rs]) for key, rs in ratios.items()}
    calibrated, raw = [], []
    for key, rs in ratios.items():
        if len(rs) < 2:
            continue
        for r, actual_s, predicted_s in rs:
            others = calibrate_stats(groups[key].minus(RatioStats.of([r])))
            calibrated.append(abs(others.factor * predicted_s - actual_s) / actual_s)
            raw.append(abs(predicted_s - actual_s) / actual_s)
    evaluation = {"actuals": sum(g.n for g in groups.values()), "groups": len(groups), "skipped": skipped,
                  "loo_n": len(raw),
                  "loo_mape_pct_calibrated": round(100 * float(sum(calibrated) / len(raw)), 4) if raw else None,
                  "loo_mape_pct_uncalibrated": round(100 * float(sum(raw) / len(raw)), 4) if raw else None}  # fmt: skip
    return JobCalibrationFit(
        watermark_measurement_id=up_to_id if up_to_id is not None else max((r.id for r in rows), default=None),
        groups={k: RatioStatsModel(n=g.n, total=g.total, total_sq=g.total_sq) for k, g in groups.items()},
        evaluation=evaluation,
    )


def estimate_jobs(session: Session, predictor: Predictor, *, request: JobEstimatesCreate) -> JobEstimatesRead:
    """``p50_s``/``p90_s``/``fits`` of each job, calibrated by the actuals of its :class:`CalibrationGroup`
    (graph, hardware, precision, stack, device count, nodes), which each answer names.

    Raises :class:`TooManyItems` (413) beyond :data:`MAX_JOBS`; per-job errors are in the answers.
    """
    _limit(request.jobs, MAX_JOBS, "jobs")
    models = _model_jobs(session, predictor, request.jobs)
    calibrations = _calibrations(session, predictor.version, request.jobs)
    answers = []
    for i, (job, m) in enumerate(zip(request.jobs, models, strict=True)):
        if isinstance(m, ItemError):
            answers.append(JobEstimateRead(index=i, error=m))
            continue
        group = _group(job)
        cal = calibrations.get(group, UNCALIBRATED)
        p50, p90 = cal.p50_p90(m.p50_s, m.p90_s)
        answers.append(JobEstimateRead(index=i, p50_s=p50, p90_s=p90, fits=m.fits, actuals=cal.actuals,
                                       calibration_factor=cal.factor, calibration_group=_group_read(group),
                                       warnings=list(m.warnings)))
    return JobEstimatesRead(predictor_version=predictor.version, count=len(answers),
                            failed=sum(a.error is not None for a in answers), estimates=answers)


@dataclass(slots=True)
class _Judged:
    """The verdict on the actuals of one report: an answer per item, the rows to store (item index → the
    :class:`Measurement` columns) and the items whose graph and device exist (stored, or refused as
    implausible), which answer the calibration their graph and hardware have."""

    answers: list[JobActualRead]
    rows: dict[int, dict[str, Any]]
    known: list[int]


#: Fields of an actual that are not the job's (``config`` holds the job, as ``JobSpec`` reads it back).
_NOT_CONFIG = frozenset({"measured_s", "context", "measured_at"})
#: Field of a stored measurement → the field of the actual it is made of, in a refusal.
_ACTUAL_FIELD = {"time_ms_median": "measured_s"}


def _actual_record(actual: JobActual, *, predicted_s: float, predictor_version: str) -> MeasurementRecord:
    """The whole-job :class:`MeasurementRecord` of ``actual`` (the record type every stored measurement is made
    of): the job's fields with the model's ``predicted_s`` and ``predictor_version`` as ``config``, its time in
    ms, ``measured_at`` in UTC."""
    config = {k: v for k, v in actual.model_dump(mode="json").items() if k not in _NOT_CONFIG}
    config.update(predicted_s=predicted_s, predictor_version=predictor_version)
    return MeasurementRecord(
        hardware_id=actual.hardware_id, source=ACTUALS_SOURCE, op_kind="job", pass_=Pass.TRAIN_STEP.value,
        optimizer=actual.optimizer, precision=actual.precision.value, software_stack=actual.software_stack,
        granularity=Granularity.JOB, batch_size=actual.batch_size, config=config,
        time_ms_median=actual.measured_s * 1e3, time_ms_std=None, repetitions=None, context=dict(actual.context),
        measured_at=actual.measured_at.astimezone(UTC) if actual.measured_at is not None else None)


def _refusal(actual: JobActual, problems: Sequence[RowProblem]) -> ItemError:
    """The item error of an actual whose measurement :func:`field_problems` refuses: its first problem, named
    by the actual's field (``measured_s`` for the stored ``time_ms_median``); ``detail.problems`` lists all."""
    first = problems[0]
    field = _ACTUAL_FIELD.get(first.field, first.field)
    message = first.message
    if field == "measured_s":
        message = f"measured_s {actual.measured_s:g} s, stored as a job measurement: {message}"
    return ItemError(code=first.code, message=message, detail={
        "field": field,
        "problems": [{"code": p.code, "field": _ACTUAL_FIELD.get(p.field, p.field), "message": p.message}
                     for p in problems]})  # fmt: skip


def _judge_actuals(session: Session, actuals: Sequence[JobActual], models: Sequence[_JobModel | ItemError], *,
                   predictor_version: str, submitter: str | None) -> _Judged:  # fmt: skip
    """Each actual against the model's answer for its job: a job that cannot be predicted fails with its
    error, one more than :data:`MAX_ACTUAL_RATIO` away from the estimate fails ``implausible_actual``, one whose
    measurement the rules of every stored measurement refuse (:func:`app.measurements.validation.field_problems`,
    as ``POST /v1/measurements`` and ``layercast import`` apply them: a job over a year, ``measured_at`` more
    than a day ahead...) fails with their code; the others become whole-job measurement rows. A job the memory
    model says does not fit (``fits: false``) is stored all the same (it ran: the measurement is real, the
    memory estimate is what disagrees) and its item carries a warning with the estimated peak against the
    device's memory."""
    judged = _Judged(answers=[], rows={}, known=[])
    specs = hardware_service.get_specs(session, hardware_ids={a.hardware_id for a in actuals})
    graph_repo = GraphRepository(session)
    graphs_seen: dict[str, bool] = {}

    def graph_exists(graph_id: str) -> bool:
        if graph_id not in graphs_seen:
            graphs_seen[graph_id] = graph_repo.exists(graph_id)
        return graphs_seen[graph_id]

    now = datetime.now(UTC)
    for i, (actual, m) in enumerate(zip(actuals, models, strict=True)):
        if isinstance(m, ItemError):
            judged.answers.append(JobActualRead(index=i, error=m))
            continue
        judged.known.append(i)
        ratio = actual.measured_s / m.p50_s
        if not 1 / MAX_ACTUAL_RATIO <= ratio <= MAX_ACTUAL_RATIO:
            judged.answers.append(JobActualRead(index=i, predicted_s=m.p50_s, ratio=ratio, error=ItemError(
                code="implausible_actual",
                message=f"measured_s {actual.measured_s:g} s is {ratio:.3g}x the estimate {m.p50_s:.4g} s; "
                        f"actuals more than {MAX_ACTUAL_RATIO:g}x away from it either way are not recorded")))
            continue
        record = _actual_record(actual, predicted_s=m.p50_s, predictor_version=predictor_version)
        problems = field_problems(record, spec=specs.get(actual.hardware_id), graph_exists=graph_exists, now=now)
        if problems:
            judged.answers.append(JobActualRead(index=i, predicted_s=m.p50_s, ratio=ratio,
                                                error=_refusal(actual, problems)))
            continue
        judged.rows[i] = {**record.to_row(), "submitter": submitter}
        warnings = [] if m.memory_warning is None else [
            f"{m.memory_warning}: the memory model says this job does not fit (fits: false), yet it ran; the "
            "actual is stored and calibrates later estimates, the memory estimate is unchanged"]
        judged.answers.append(JobActualRead(index=i, predicted_s=m.p50_s, ratio=ratio, warnings=warnings))
    return judged


def _replayed(row: MeasurementBatch, idempotency_key: str) -> JobActualsRead:
    assert row.answer is not None  # same digest: the same actuals body, whose answer was stored with it
    return JobActualsRead.model_validate(row.answer).model_copy(
        update={"idempotency_key": idempotency_key, "replayed": True})


def record_actuals(session: Session, predictor: Predictor, *, request: JobActualsCreate,
                   submitter: str | None = None, idempotency_key: str | None = None) -> JobActualsRead:
    """Store each measured job as a whole-job measurement (``granularity`` ``job``, source
    :data:`ACTUALS_SOURCE`) with the model's uncalibrated p50 at recording time and the predictor version,
    so later estimates of the same setting (:class:`CalibrationGroup`) are calibrated by it; recorded as
    reported by the API
    key id ``submitter`` (None: anonymous), as ``POST /v1/measurements`` rows are. Flushes.

    ``idempotency_key`` works as ``POST /v1/measurements``' (the same mechanism and table:
    :func:`app.measurements.service.idempotent_request`, ``stored_batch``, ``claim_batch``): a report stored
    before under the key with the same body is answered again (``replayed``; the first answer, nothing stored),
    one with another body raises :class:`app.measurements.service.IdempotencyKeyReused` (409), a malformed key
    :class:`app.measurements.service.InvalidIdempotencyKey` (422).

    Raises :class:`TooManyItems` (413) beyond :data:`MAX_JOBS`; a job that cannot be predicted (unknown
    graph or device...) is not stored and says why; one refused as ``implausible_actual`` still answers the
    ``actuals`` and ``calibration_factor`` its calibration group has (each answer names the group). When no
    item is recorded, raises :class:`app.errors.InvalidActuals` (422 ``invalid_actuals``, ``detail``: that
    answer), nothing stored and the key not claimed.
    """
    _limit(request.actuals, MAX_JOBS, "actuals")
    idem = idempotent_request(idempotency_key, submitter=submitter, body=request)
    seen = stored_batch(session, idem)
    if idem is not None and seen is not None:
        return _replayed(seen, idem.idempotency_key)
    models = _model_jobs(session, predictor, request.actuals)
    judged = _judge_actuals(session, request.actuals, models, predictor_version=predictor.version,
                            submitter=submitter)
    claim: MeasurementBatch | None = None
    if idem is not None and judged.rows:  # a report that stores nothing does not use its key up
        claim, won = claim_batch(session, idem)
        if not won:
            return _replayed(claim, idem.idempotency_key)
    ids = MeasurementRepository(session).insert_returning_ids(list(judged.rows.values()))
    for i, measurement_id in zip(judged.rows, ids, strict=True):
        judged.answers[i].measurement_id = measurement_id
    calibrations = _calibrations(session, predictor.version, request.actuals)
    for i in judged.known:  # the calibration its group now has, whether this one was stored or not
        group = _group(request.actuals[i])
        cal = calibrations.get(group, UNCALIBRATED)
        read = judged.answers[i]
        read.actuals, read.calibration_factor = cal.actuals, cal.factor
        read.calibration_group = _group_read(group)
    answer = JobActualsRead(predictor_version=predictor.version, recorded=len(ids),
                            failed=len(judged.answers) - len(ids), actuals=judged.answers,
                            idempotency_key=idempotency_key)
    if not ids:
        first = next(a for a in judged.answers if a.error is not None)
        assert first.error is not None
        raise InvalidActuals(
            f"none of the {len(judged.answers)} actuals can be recorded (first: item {first.index}, "
            f"{first.error.code}); nothing was stored", detail=answer.model_dump(mode="json"))
    if claim is not None:
        claim.measurement_ids, claim.answer = ids, answer.model_dump(mode="json")
        session.flush()
    return answer


# ------------------------------------------------------------------------------------------ comparisons


def _headline(row: ComparisonRow) -> tuple[float, float, float]:
    inf = math.inf
    return (row.job_s, inf if row.cost_usd is None else row.cost_usd, inf if row.energy_j is None else row.energy_j)


def mark_pareto(rows: Sequence[ComparisonRow]) -> None:
    """Set ``pareto`` on each fitting row no other fitting row dominates over (job time, cost, energy): at
    least as good in all three, better in one. Unknown cost/energy counts as worst; rows that do not fit
    are never on the front. O(n²), n ≤ a few hundred rows."""
    fitting = [(r, _headline(r)) for r in rows if r.fits]
    for r in rows:
        r.pareto = False
    for r, a in fitting:
        r.pareto = not any(all(x <= y for x, y in zip(b, a, strict=True)) and b != a for _, b in fitting)


def _sort_key(sort_by: str) -> Callable[[ComparisonRow], Any]:
    if sort_by == "hardware_id":
        return lambda r: (r.hardware_id, r.device_count)
    return lambda r: (math.inf if getattr(r, sort_by) is None else getattr(r, sort_by), r.hardware_id)


def _spread(request: ComparisonCreate, n: int) -> dict[str, Any]:
    """The node fields of ``n`` devices of a comparison: one node up to ``devices_per_node``, else
    ``ceil(n / devices_per_node)`` nodes (a count that does not spread evenly is refused by the
    prediction's own validation, so its row is unavailable)."""
    per_node = request.devices_per_node
    if per_node is None or n <= per_node:
        return {"nodes": 1}
    return {"nodes": math.ceil(n / per_node),
            "inter_node_bandwidth_bytes_per_s": request.inter_node_bandwidth_bytes_per_s,
            "inter_node_latency_s": request.inter_node_latency_s}


def _sweep_sizes(sweep: BatchSweep | None) -> list[int]:
    """The sweep's batch sizes, ascending (empty without a sweep); raises :class:`DuplicateBatchSizes` (422)
    when one is given twice."""
    if sweep is None:
        return []
    duplicates = sorted(b for b, n in Counter(sweep.batch_sizes).items() if n > 1)
    if duplicates:
        raise DuplicateBatchSizes(
            f"the sweep names batch size(s) {', '.join(map(str, duplicates))} more than once; give each once",
            detail={"duplicates": duplicates})
    return sorted(sweep.batch_sizes)


#: Errors of a comparison's ``dims`` against its graph: the same on every device and device count, so the
#: request is refused (422) as its sweep's would be, not answered as a table of identical ``unavailable`` rows.
_REQUEST_ERRORS = (UnboundDimension, UnknownDimension, BatchAxisInDims)


def compare(session: Session, predictor: Predictor, *, request: ComparisonCreate) -> ComparisonRead:
    """One row per (device, device count) that can run the job; the others in ``unavailable`` with their
    code; Pareto front over job time, cost and energy; optional batch-size sweep on one device.

    Raises :class:`app.errors.GraphNotFound` (404) for an unknown graph, :class:`app.errors.InvalidRequest`
    (422, ``detail.unknown_price_ids``) when ``price_usd_per_hour`` names a device the comparison does not
    include, :class:`app.errors.DuplicateBatchSizes` (422, ``detail.duplicates``) for a sweep that names a batch
    size twice, the :data:`_REQUEST_ERRORS` (422) for ``dims`` that do not bind the graph, and, for the sweep,
    the errors of its device and batch sizes (404/422); unknown hardware ids of the rows are listed as
    unavailable. The sweep's rows are in ascending batch size.
    """
    sweep_sizes = _sweep_sizes(request.sweep)
    cache = GraphCache(session, predictor)
    graphs.get_graph(session, graph_id=request.graph_id)
    hardware_ids = (request.hardware_ids if request.hardware_ids is not None
                    else [h.id for h in hardware_service.list_hardware(session).items])
    unpriced = sorted(set(request.price_usd_per_hour) - set(hardware_ids))
    if unpriced:  # a typo'd or uncompared id would silently leave its device at the catalog price
        raise InvalidRequest(
            f"price_usd_per_hour names hardware the comparison does not include: {', '.join(map(repr, unpriced))}"
            f" (it compares {'hardware_ids' if request.hardware_ids is not None else 'every stored device'})",
            detail={"unknown_price_ids": unpriced},
        )
    base = JobSpec(graph_id=request.graph_id, hardware_id="", batch_size=request.batch_size,
                   dataset_size=request.dataset_size, epochs=request.epochs, precision=request.precision,
                   optimizer=request.optimizer, software_stack=request.software_stack, dims=request.dims,
                   **run_settings(request))
    extra: dict[str, Any] = {"mode": request.mode, "grid_gco2_per_kwh": request.grid_gco2_per_kwh}
    # the dims are the request's, the same on every row: refused here even when every row fails before binding
    cache.check_binding(_job_request(base, **extra))
    unavailable: list[Unavailable] = []
    scenarios: list[Scenario] = []
    for hw_id in dict.fromkeys(hardware_ids):
        for n in dict.fromkeys(request.device_counts):  # a count given twice is one row, as an id given twice
            job = base.model_copy(update={"hardware_id": hw_id, "device_count": n, **_spread(request, n)})
            s = _attempt(partial(_job_scenario, cache, job, price_usd_per_hour=request.price_usd_per_hour.get(hw_id),
                                 **extra), raising=_REQUEST_ERRORS)
            if isinstance(s, ItemError):
                unavailable.append(Unavailable(hardware_id=hw_id, device_count=n, code=s.code, reason=s.message,
                                               detail=s.detail))
            else:
                scenarios.append(s)
    sweep = request.sweep
    sweep_scenarios = [] if sweep is None else [
        _job_scenario(cache, base.model_copy(update={"hardware_id": sweep.hardware_id, "batch_size": b}), **extra)
        for b in sweep_sizes
    ]
    found = engine.predict_layers(cache, scenarios + sweep_scenarios)
    rows: list[ComparisonRow] = []
    for s, sums in zip(scenarios, found.sums[: len(scenarios)], strict=True):
        row = _attempt(partial(_comparison_row, cache, s, sums))
        if isinstance(row, ItemError):
            unavailable.append(Unavailable(hardware_id=s.hardware.id, device_count=s.request.device_count,
                                           code=row.code, reason=row.message, detail=row.detail))
        else:
            rows.append(row)
    mark_pareto(rows)
    rows.sort(key=_sort_key(request.sort_by))
    sweep_rows = None
    if request.sweep is not None:
        sweep_rows = []
        for s, sums in zip(sweep_scenarios, found.sums[len(scenarios):], strict=True):
            it = engine.scenario_aggregate(cache, s, sums).iteration
            sweep_rows.append(SweepRow(batch_size=s.request.batch_size, iteration_ms=it.time_ms,
                                       time_per_sample_ms=it.time_ms / s.request.batch_size,
                                       peak_memory_bytes=cache.footprint(s).total_bytes, fits=cache.fits(s)))
    return ComparisonRead(
        graph_id=request.graph_id, predictor_version=predictor.version, sort_by=request.sort_by, rows=rows,
        unavailable=unavailable, sweep=sweep_rows,
        assumptions={
            "aggregation": "each row is the POST /v1/predictions answer for that device and device count "
                           "(app.core.aggregate: layers + exposed ring all-reduce of the fp32 gradients in DDP "
                           "buckets overlapped with backward; epoch = ceil(dataset / global batch) iterations; "
                           "job = epochs x epoch, in whole iterations: a fraction of an epoch runs "
                           "ceil(fraction x dataset / global batch) of them, at least 1)",
            "energy": "estimate: idle + (TDP - idle) x utilisation of each layer's roofline bound, idle power "
                      "the rest of the step, all devices; device energy only (no host, network, cooling)",
            "cost": "device-hours x price per device-hour (the catalog's list price unless overridden); null "
                    "without a price",
            "pareto": "fitting rows not dominated in (job_s, cost_usd, energy_j); unknown cost or energy is worst",
            "precision": PRECISION_SEMANTICS[request.precision],
        },
    )


def _comparison_row(cache: GraphCache, s: Scenario, sums: LayerSums) -> ComparisonRow:
    agg = engine.scenario_aggregate(cache, s, sums)
    assert agg.epoch is not None and agg.job is not None
    it, job = agg.iteration, agg.job
    return ComparisonRow(
        hardware_id=s.hardware.id, device_count=it.device_count, nodes=s.request.nodes,
        per_device_batch_size=it.per_device_batch_size,
        iteration_ms=it.time_ms, iteration_ms_p90=it.time_ms_p90, samples_per_s=it.samples_per_s,
        scaling_efficiency=it.scaling_efficiency, allreduce_exposed_ms=it.allreduce_exposed_ms,
        epoch_s=agg.epoch.time_s, job_s=job.time_s, job_s_p90=job.time_s_p90, cost_usd=job.cost_usd,
        energy_j=job.energy_j, co2_kg=job.co2_kg, peak_memory_bytes=cache.footprint(s).total_bytes,
        fits=cache.fits(s), largest_batch_size_that_fits=cache.largest_batch(s), pareto=False,
    )
