"""``layercast retrain``: train a candidate on every stored measurement, gate it against production, promote
it or not, and record the decision (issue 10 item 3).

Stages of :func:`run_retrain`:

1. **watermark**: the newest measurement id (and its ``created_at``) at the start; later rows are left out
   of the evaluation (a row that lands during training may still be trained on: the loader reads once).
2. **train**: the rows (:func:`evaluation_rows`: the imported sources and every reported source,
   :func:`with_reported_sources`: rows ingested through ``POST /v1/measurements``; every **frozen
   benchmark** row left out: a row is in the benchmark when the SHA-256 of ``BENCHMARK_SALT + its
   configuration key`` (:func:`app.training.dataset.config_key`: the shape without device, pass, optimizer
   and precision) falls below ``benchmark_fraction``; membership depends on the key alone, so it stays
   frozen as data grows, and no version trained here ever sees it. The shipped seed version predates the
   benchmark and did train on some of it: that favours production, the safe side.) Then one of two:

   - **fine-tune** when the training split holds GPUs that production's ``training_hardware`` does not list
     (:func:`app.training.new_hardware.new_devices`: measurements of hardware it never trained on) and its
     torch weights load (:func:`finetuned_candidate`: production's weights tuned on those devices' training
     rows, the known devices' replayed, :func:`app.training.new_hardware.adapt`);
   - otherwise **from scratch** (:func:`app.training.train.run`, nothing re-implemented, on the same rows)
     into a temporary folder inside the artifact store.

   ``metrics["training"]`` of the run records which and why.
3. **evaluate** candidate and production on the same rows: the candidate's **fresh held-out** test split
   (:func:`app.training.train.splits` of the non-benchmark rows, the split the candidate was scored on)
   and the benchmark. Metrics (:func:`app.training.metrics.metrics` of the p50) overall, per source,
   per hardware id, per precision and per op family.
4. **gate** (:func:`gate`): on each of the two splits the candidate's MAPE must be at most production's
   times ``1 + overall_tolerance`` overall and ``1 + group_tolerance`` on every hardware id and every
   precision with at least ``min_group_rows`` rows in the split.
5. **register and decide** in one transaction: the ONNX file and the torch weights (``.weights.npz``, the
   base of a later fine-tune) copied into the store atomically (:func:`app.predictor.metadata.write_atomic`,
   the weights' SHA-256 in the metadata), the version registered as a candidate with its typed
   metadata, promoted when the gate passed, the :class:`app.predictors.models.RetrainRun` row finished
   with both sets of metrics, every gate check and the reason.

6. **new hardware** (:mod:`app.training.new_hardware`): for every GPU the candidate was fine-tuned for, the
   learning curve of that same fine-tune on 25, 50, 100 and 200 of its training rows, scored on its rows of
   the held-out split (Syed & Srinivasan 2021), recorded under ``metrics["new_hardware"]`` and logged as a
   table.

7. **job calibration** (:func:`app.estimates.service.refit_job_calibration`): every scheduler actual
   (``POST /v1/job-estimates/actuals``, whole-job rows of the measurement table) up to the watermark is
   re-predicted by the candidate and summarised per (graph, hardware, precision, device count, nodes) into
   its metadata, so a new version
   starts calibrated by every actual ever recorded, not only by those recorded against it; its
   leave-one-out whole-job error with and without calibration is in ``metrics["job_calibration"]``.

A failure anywhere (training, export, writing the artifact) marks the run ``failed`` and leaves the
production row untouched; the temporary folder is always removed.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db import make_engine, make_sessionmaker, utcnow
from app.estimates.service import refit_job_calibration
from app.measurements.importers import IMPORT_SOURCES
from app.measurements.models import Measurement
from app.observability import record_retrain
from app.predictor.metadata import ArtifactMetadata, Watermark, sha256_file, write_atomic
from app.predictor.onnx_model import LearnedPredictor
from app.predictor.registry import load_from_store
from app.predictors import service
from app.predictors.models import RetrainRun
from app.training import new_hardware
from app.training.dataset import TrainingRows
from app.training.finetune import write_finetuned
from app.training.metrics import metrics
from app.training.train import (
    DEFAULT_SAMPLE,
    DEFAULTS,
    V3_SOURCES,
    KindHeads,
    is_cpu_rows,
    load_training_data,
    splits,
)
from app.training.train import run as train_run

#: Salt of the benchmark membership hash; changing it defines a new benchmark (never do it silently).
BENCHMARK_SALT = "layercast-frozen-benchmark-v1:"

#: Splits every candidate is gated on.
SPLITS = ("held_out", "benchmark")


@dataclass(frozen=True, slots=True)
class RetrainConfig:
    """Settings of one retrain run. Model settings as :mod:`app.training.train` (``sample``: rows per
    imported file of every GPU source, None = :data:`app.training.train.DEFAULT_SAMPLE`); tolerances are
    relative (0.10 = a MAPE up to 10 % higher than production's passes). ``reported``: also train on the GPU
    rows of every reported source stored (``POST /v1/measurements``: ``ci``, ``profiler-upload``...; all of
    their rows, unsampled), added to ``sources`` by :func:`with_reported_sources`. ``finetune_epochs``: of the
    fine-tune for hardware new to production and of each point of its learning curve (``curve_sizes``)."""

    epochs: int = int(DEFAULTS["epochs"])
    hidden: int = int(DEFAULTS["hidden"])
    depth: int = int(DEFAULTS["depth"])
    ensemble: int = int(DEFAULTS["ensemble"])
    sample: int | None = None
    seed: int = 0
    sources: tuple[str, ...] = V3_SOURCES
    cpu: bool = True
    logo: bool = False
    threads: int = 1
    benchmark_fraction: float = 0.1
    overall_tolerance: float = 0.0
    group_tolerance: float = 0.10
    min_group_rows: int = 20
    reported: bool = True
    curve_sizes: tuple[int, ...] = new_hardware.CURVE_SIZES
    finetune_epochs: int = 30

    def sample_per_source(self) -> dict[str, int | None]:
        """Rows per imported file of each GPU source."""
        return dict(DEFAULT_SAMPLE) if self.sample is None else {k: self.sample for k in DEFAULT_SAMPLE}


def with_reported_sources(session: Session, cfg: RetrainConfig) -> RetrainConfig:
    """``cfg`` with every stored source that no importer writes appended to ``sources`` (when
    ``cfg.reported``), so measurements ingested through the API feed the next candidate."""
    if not cfg.reported:
        return cfg
    stored = session.scalars(select(Measurement.source).distinct()).all()
    extra = sorted(s for s in stored if s not in IMPORT_SOURCES and s not in cfg.sources)
    return replace(cfg, sources=(*cfg.sources, *extra)) if extra else cfg


def in_benchmark(config_keys: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean ``[N]``: rows whose configuration key hashes below ``fraction`` (see module docstring)."""
    keys, inverse = np.unique(np.asarray(config_keys).astype(str), return_inverse=True)
    u = np.array([int(hashlib.sha256((BENCHMARK_SALT + k).encode()).hexdigest()[:12], 16) / 16**12 for k in keys])
    return (u < fraction)[inverse] if len(keys) else np.zeros(0, dtype=bool)


def evaluate_on(predictor: LearnedPredictor, data: TrainingRows) -> dict[str, Any]:
    """Metrics of ``predictor``'s p50 (and 80 % interval) on ``data``: ``overall`` and ``by_source``,
    ``by_hardware``, ``by_precision``, ``by_family`` (op family; each :func:`app.training.metrics.metrics`)."""
    pred = np.exp(predictor.run_features(data.features).astype(np.float64))
    out: dict[str, Any] = {"overall": metrics(data.time_ms, pred[:, 1], pred[:, 0], pred[:, 2])}
    for name, column in (("by_source", data.source), ("by_hardware", data.gpu), ("by_precision", data.precision),
                         ("by_family", data.family)):  # fmt: skip
        out[name] = {str(v): metrics(data.time_ms[column == v], pred[column == v, 1], pred[column == v, 0],
                                     pred[column == v, 2]) for v in np.unique(column)}  # fmt: skip
    return out


def gate(
    candidate: Mapping[str, Any], production: Mapping[str, Any], cfg: RetrainConfig
) -> tuple[bool, list[dict[str, Any]]]:
    """Compare per split (:data:`SPLITS`) overall and per hardware / precision MAPE (module docstring).

    Returns ``(passed, checks)``; each check names ``split``, ``group`` (``overall``, ``hardware:<id>``,
    ``precision:<p>``), both MAPEs (%), the allowed maximum and ``passed``.
    """
    checks: list[dict[str, Any]] = []
    for split in SPLITS:
        c, p = candidate[split], production[split]
        pairs = [("overall", c["overall"], p["overall"], cfg.overall_tolerance)]
        for by, label in (("by_hardware", "hardware"), ("by_precision", "precision")):
            for key in sorted(set(c[by]) & set(p[by])):
                if c[by][key].get("n", 0) >= cfg.min_group_rows:
                    pairs.append((f"{label}:{key}", c[by][key], p[by][key], cfg.group_tolerance))
        for group, cm, pm, tol in pairs:
            if cm.get("n", 0) == 0:
                continue
            allowed = pm["mape_pct"] * (1 + tol)
            checks.append({"split": split, "group": group, "n": cm["n"], "candidate_mape_pct": cm["mape_pct"],
                           "production_mape_pct": pm["mape_pct"], "max_mape_pct": round(allowed, 4),
                           "passed": bool(cm["mape_pct"] <= allowed)})  # fmt: skip
    return bool(checks) and all(ch["passed"] for ch in checks), checks


def _watermark(session: Session) -> Watermark:
    max_id, max_at = session.execute(select(func.max(Measurement.id), func.max(Measurement.created_at))).one()
    return Watermark(max_measurement_id=max_id, max_created_at=max_at)


def evaluation_rows(database_url: str, cfg: RetrainConfig, max_measurement_id: int | None) -> dict[str, TrainingRows]:
    """``{"train", "val", "held_out": the candidate's train / validation / test split of the rows outside the
    benchmark, "benchmark": the frozen benchmark}``, the same rows, sampling and split the trainer uses
    (deterministic for the seed), measurement ids up to the watermark."""
    gpu, cpu, _ = load_training_data(database_url=database_url, sources=cfg.sources, cpu=cfg.cpu,
                                     sample=cfg.sample_per_source(), seed=cfg.seed, log=lambda s: None)  # fmt: skip
    parts = [d for d in (gpu, cpu) if d is not None and len(d)]
    if max_measurement_id is not None:
        parts = [d.subset(d.measurement_id <= max_measurement_id) for d in parts]
    bench = [d.subset(in_benchmark(d.config, cfg.benchmark_fraction)) for d in parts]
    rest = [d.subset(~in_benchmark(d.config, cfg.benchmark_fraction)) for d in parts]
    train, val, held_out = splits(rest[0], rest[1] if len(rest) > 1 else None, seed=cfg.seed)
    return {"train": train, "val": val, "held_out": held_out,
            "benchmark": TrainingRows.concat([b for b in bench if len(b)] or bench[:1])}  # fmt: skip


def _gpu(rows: TrainingRows) -> TrainingRows:
    return rows.subset(~is_cpu_rows(rows))


def finetuned_candidate(
    base: KindHeads,
    production: ArtifactMetadata,
    devices: Sequence[str],
    rows: Mapping[str, TrainingRows],
    *,
    out_dir: Path,
    version: str,
    cfg: RetrainConfig,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The candidate of a retrain that found ``devices`` new to ``production``: its weights ``base``
    fine-tuned (:func:`app.training.new_hardware.adapt`, ``cfg.finetune_epochs``) on the devices' rows of the
    ``train`` split of ``rows`` (:func:`evaluation_rows`; the held-out split and the benchmark stay unseen),
    the interval recalibrated on their ``val`` rows, the known devices' training rows replayed; written into
    ``out_dir`` as version ``version`` (:func:`app.training.finetune.write_finetuned`). Returns its
    trainer-style metadata."""
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    train, val = _gpu(rows["train"]), _gpu(rows["val"])
    new = np.isin(train.gpu, list(devices))
    tune, known, calib = train.subset(new), train.subset(~new), val.subset(np.isin(val.gpu, list(devices)))
    log(f"new hardware {list(devices)}: fine-tuning {production.version} on {len(tune)} of their rows "
        f"({len(calib)} calibrate the interval, {min(len(known), new_hardware.REPLAY_ROWS)} known rows replayed)")
    model = production.training["model"]
    tuned, scales = new_hardware.adapt(base, model["conformal_scales"], tune, calib=calib, known=known,
                                       logo_factor=model["gpu_interval_logo_factor"], epochs=cfg.finetune_epochs,
                                       seed=cfg.seed, log=log)  # fmt: skip
    record = {"rows": {"tuning": len(tune), "calibration": len(calib),
                       "replayed": min(len(known), new_hardware.REPLAY_ROWS)},
              "epochs": cfg.finetune_epochs, "seed": cfg.seed}  # fmt: skip
    return write_finetuned(tuned, base_training=production.training, base_version=production.version, scales=scales,
                           tune=tune, hardware={g: tune.hardware[g] for g in devices}, out_dir=out_dir,
                           version=version, record=record)  # fmt: skip


def _new_hardware_base(
    store_dir: Path, production: ArtifactMetadata, rows: Mapping[str, TrainingRows], log: Callable[[str], None]
) -> tuple[list[str], KindHeads | None, dict[str, Any]]:
    """``(devices, base, how)``: the GPUs of the training split new to production
    (:func:`app.training.new_hardware.new_devices`), production's weights when there are some and they load
    (the candidate is then fine-tuned from them), else None (trained from scratch); ``how`` records which
    (``method`` ``finetune`` or ``scratch``, and why)."""
    devices = new_hardware.new_devices(rows["train"], production)
    if not devices:
        return [], None, {"method": "scratch", "reason": "no hardware new to production"}
    try:
        base = new_hardware.production_weights(store_dir, production)
    except (FileNotFoundError, ValueError) as exc:
        why = f"new hardware {devices}, but production's weights cannot be loaded ({exc}): trained from scratch"
        log(why)
        return devices, None, {"method": "scratch", "reason": why, "hardware_ids": devices}
    return devices, base, {"method": "finetune", "base": production.version, "hardware_ids": devices,
                           "reason": f"hardware new to production: {', '.join(devices)}"}  # fmt: skip


def run_retrain(*, database_url: str, store_dir: Path, cfg: RetrainConfig, trigger: str = "cli",
                run_id: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """One retrain run (module docstring); returns the finished run as a dict (``status`` ``promoted`` or
    ``rejected``). ``run_id`` continues a ``requested`` run (the worker). Raises ``ValueError`` without a
    production version or measurements, and re-raises any training failure after recording it."""
    store_dir = Path(store_dir)
    engine = make_engine(database_url)
    factory = make_sessionmaker(engine)
    tmp: Path | None = None
    try:
        with factory.begin() as session:
            prod_row = service.production(session)
            if prod_row is None:
                raise ValueError("no production predictor is registered: start the API once (it seeds one)")
            prod_meta = service.metadata_of(prod_row)
            mark = _watermark(session)
            cfg = with_reported_sources(session, cfg)
            run = session.get(RetrainRun, run_id) if run_id is not None else None
            if run is None:
                run = RetrainRun(status="running", trigger=trigger, metrics={}, gate={})
                session.add(run)
            run.status, run.started_at = "running", utcnow()
            run.production_version, run.watermark_measurement_id = prod_meta.version, mark.max_measurement_id
            session.flush()
            run_id = run.id
        log(f"retrain run {run_id}: production {prod_meta.version}, watermark measurement {mark.max_measurement_id}")
        try:
            production = load_from_store(store_dir, prod_meta).learned
            store_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".retrain-", dir=store_dir))
            suffix = f"r{run_id}-{utcnow():%Y%m%d%H%M%S}"
            rows = evaluation_rows(database_url, cfg, mark.max_measurement_id)
            devices, base, how = _new_hardware_base(store_dir, prod_meta, rows, log)
            if base is not None:
                training = finetuned_candidate(base, prod_meta, devices, rows, out_dir=tmp, version=f"{suffix}-ft",
                                               cfg=cfg, log=log)  # fmt: skip
            else:
                frac = cfg.benchmark_fraction
                training = train_run(
                    database_url=database_url, out_dir=tmp, epochs=cfg.epochs, sample=cfg.sample_per_source(),
                    seed=cfg.seed, version=suffix, sources=cfg.sources, cpu=cfg.cpu, logo=cfg.logo,
                    hidden=cfg.hidden, depth=cfg.depth, ensemble=cfg.ensemble, threads=cfg.threads,
                    write_current=False, argv=("retrain", f"run {run_id}"), log=log,
                    keep_rows=lambda rows: ~in_benchmark(rows.config, frac),
                )  # fmt: skip
            candidate = LearnedPredictor(tmp / training["onnx_file"], training, threads=cfg.threads)
            cand_m = {s: evaluate_on(candidate, rows[s]) for s in SPLITS}
            prod_m = {s: evaluate_on(production, rows[s]) for s in SPLITS}
            passed, checks = gate(cand_m, prod_m, cfg)
            new_hw: dict[str, Any] = {"error": how["reason"], "devices": devices} if devices and base is None else {}
            if base is not None:
                new_hw = new_hardware.curves(
                    base, prod_meta.training["model"]["conformal_scales"], devices, train=_gpu(rows["train"]),
                    val=_gpu(rows["val"]), held_out=_gpu(rows["held_out"]), sizes=cfg.curve_sizes,
                    epochs=cfg.finetune_epochs, seed=cfg.seed, log=log)  # fmt: skip
                log("new hardware learning curve (held-out rows of each device):\n" + new_hardware.markdown(new_hw))
            failed = [f"{c['split']} {c['group']}: {c['candidate_mape_pct']:.2f} % > {c['max_mape_pct']:.2f} %"
                      for c in checks if not c["passed"]]  # fmt: skip
            reason = ("not worse than production overall nor on any hardware or precision" if passed
                      else "worse than production: " + "; ".join(failed))  # fmt: skip
            for name in (training["onnx_file"], training["weights_file"]):  # weights: the next fine-tune's base
                write_atomic(store_dir / name, (tmp / name).read_bytes())
            mark = mark.model_copy(update={"rows": int(training["training_data"]["rows"]["train"])})
            meta = ArtifactMetadata.from_training(
                training, sha256=sha256_file(store_dir / training["onnx_file"]), watermark=mark, metrics=cand_m,
                weights_sha256=sha256_file(store_dir / training["weights_file"]))  # fmt: skip
            with factory() as session:  # the whole-job calibration, refit on every recorded actual
                fit = refit_job_calibration(session, load_from_store(store_dir, meta, threads=cfg.threads),
                                            up_to_id=mark.max_measurement_id)  # fmt: skip
            meta = meta.model_copy(update={"job_calibration": fit})
            with factory.begin() as session:
                service.register(session, meta)
                if passed:
                    service.promote(session, meta.version)
                run = session.get(RetrainRun, run_id)
                assert run is not None
                run.status = "promoted" if passed else "rejected"
                run.candidate_version, run.reason, run.finished_at = meta.version, reason, utcnow()
                run.metrics = {"candidate": cand_m, "production": prod_m, "new_hardware": new_hw, "training": how,
                               "job_calibration": fit.evaluation, "config": asdict(cfg)}
                run.gate = {"passed": passed, "checks": checks}
                result = _run_dict(run)
            log(f"retrain run {run_id}: {meta.version} {result['status']} ({reason})")
            record_retrain("promoted" if passed else "rejected")
            return result
        except BaseException as exc:
            with factory.begin() as session:
                run = session.get(RetrainRun, run_id)
                if run is not None:
                    run.status, run.finished_at = "failed", utcnow()
                    run.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4000]
            record_retrain("failed")
            raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        engine.dispose()


def _run_dict(run: RetrainRun) -> dict[str, Any]:
    return {"id": run.id, "status": run.status, "trigger": run.trigger, "candidate_version": run.candidate_version,
            "production_version": run.production_version, "reason": run.reason, "metrics": run.metrics,
            "gate": run.gate, "watermark_measurement_id": run.watermark_measurement_id}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``layercast retrain``."""
    d = RetrainConfig()
    p = argparse.ArgumentParser(prog="layercast retrain", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--database-url", default=None, help="default $LAYERCAST_DATABASE_URL")
    p.add_argument("--store", type=Path, default=None, help="artifact store (default $LAYERCAST_ARTIFACT_STORE)")
    p.add_argument("--sources", nargs="+", default=list(d.sources))
    p.add_argument("--no-cpu", action="store_true")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--depth", type=int, default=d.depth)
    p.add_argument("--ensemble", type=int, default=d.ensemble)
    p.add_argument("--sample", type=int, default=None, help="rows per imported file of every GPU source")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--logo", action="store_true", help="leave-one-GPU-out interval calibration (slow)")
    p.add_argument("--benchmark-fraction", type=float, default=d.benchmark_fraction)
    p.add_argument("--overall-tolerance", type=float, default=d.overall_tolerance)
    p.add_argument("--group-tolerance", type=float, default=d.group_tolerance)
    p.add_argument("--min-group-rows", type=int, default=d.min_group_rows)
    p.add_argument("--no-reported", action="store_true", help="train on --sources only, not on reported rows")
    p.add_argument("--finetune-epochs", type=int, default=d.finetune_epochs,
                   help="epochs of the fine-tune for hardware new to production (and of its learning curve)")
    return p


def config_from_args(a: argparse.Namespace) -> RetrainConfig:
    """The :class:`RetrainConfig` of parsed ``layercast retrain`` arguments."""
    return RetrainConfig(epochs=a.epochs, hidden=a.hidden, depth=a.depth, ensemble=a.ensemble, sample=a.sample,
                         seed=a.seed, sources=tuple(a.sources), cpu=not a.no_cpu, logo=a.logo,
                         benchmark_fraction=a.benchmark_fraction, overall_tolerance=a.overall_tolerance,
                         group_tolerance=a.group_tolerance, min_group_rows=a.min_group_rows,
                         reported=not a.no_reported, finetune_epochs=a.finetune_epochs)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``layercast retrain``: exit 0 promoted, 3 rejected (production unchanged), 4 another retrain is
    running (:func:`app.training.worker.retrain_lock`); a failure raises (recorded as ``failed``)."""
    from app.config import Settings
    from app.training.worker import retrain_lock

    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    settings = Settings()
    database_url = a.database_url or settings.database_url
    engine = make_engine(database_url)
    try:
        with retrain_lock(engine) as got:
            if not got:
                print("another retrain run holds the lock; try again later", file=sys.stderr)
                return 4
            result = run_retrain(database_url=database_url, store_dir=a.store or settings.artifact_store_dir,
                                 cfg=config_from_args(a))  # fmt: skip
    finally:
        engine.dispose()
    return 0 if result["status"] == "promoted" else 3


if __name__ == "__main__":
    raise SystemExit(main())
