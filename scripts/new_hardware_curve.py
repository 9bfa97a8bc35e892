"""The new-hardware path of ``layercast retrain`` at full scale (issue 10 item 6): a production version that
never saw one real GPU, that GPU's measurements stored, one retrain: the candidate it fine-tunes for the GPU,
the gate's verdict, and the learning curve of that fine-tune at 25, 50, 100 and 200 of its measurements
(Syed & Srinivasan 2021).

Usage: ``python scripts/new_hardware_curve.py [--device t4] [--database-url URL] [--skip-import]
[--store DIR] [--out reports/new_hardware_t4]`` (about 10 minutes on 2 cores; writes ``<out>.md`` and
``<out>.json``).

Steps, with the project's own code only:

1. import Justus, NeuSight and Vidur (``layercast import``; ``--skip-import`` when the database has them);
2. train the shipped recipe (:func:`app.training.train.run`, :data:`app.training.train.DEFAULTS`, the default
   per-file sampling, no leave-one-GPU-out) on every GPU row outside the retrain's frozen benchmark except
   ``--device``'s, and register it as the production version (``predictor_versions``): the production
   that never saw that GPU;
3. :func:`app.training.retrain.run_retrain` with its defaults on those sources (GPU only, imports only):
   it finds ``--device`` new to production, fine-tunes production's weights on the device's rows of its
   training split (:func:`app.training.new_hardware.adapt`), gates the candidate on its fresh held-out
   split and the frozen benchmark, and measures the learning curve of the same fine-tune on the device's
   held-out rows. The report is that run's record (``retrain_runs``): nothing here re-implements it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import REPO_ROOT  # noqa: E402
from app.db import make_engine, make_sessionmaker  # noqa: E402
from app.measurements.cli import main as import_main  # noqa: E402
from app.migrate import upgrade  # noqa: E402
from app.predictor.metadata import ArtifactMetadata, sha256_file  # noqa: E402
from app.predictors import service  # noqa: E402
from app.training import new_hardware  # noqa: E402
from app.training.dataset import TrainingRows  # noqa: E402
from app.training.retrain import RetrainConfig, in_benchmark, run_retrain  # noqa: E402
from app.training.train import DEFAULT_SAMPLE, DEFAULTS  # noqa: E402
from app.training.train import run as train_run  # noqa: E402

SOURCES = ("justus2018", "neusight", "vidur")


def register_production(database_url: str, store: Path, training: dict[str, Any]) -> str:
    """Register the artifact ``training`` wrote into ``store`` and promote it; returns its version."""
    meta = ArtifactMetadata.from_training(training, sha256=sha256_file(store / training["onnx_file"]),
                                          weights_sha256=sha256_file(store / training["weights_file"]))  # fmt: skip
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            service.register(session, meta)
            service.promote(session, meta.version)
    finally:
        engine.dispose()
    return meta.version


def report(device: str, result: dict[str, Any], base_rows: dict[str, Any], wall_s: float, reproduce: str) -> str:
    """The Markdown report of the retrain run ``result``."""
    m = result["metrics"]
    curve = m["new_hardware"][device]
    dev = {who: m[who]["held_out"]["by_hardware"][device] for who in ("candidate", "production")}
    failed = [c for c in result["gate"]["checks"] if not c["passed"]]
    tuning = m["training"]
    lines = [
        f"# New hardware: {device} measurements reach a production version that never saw a {device}", "",
        f"Production: the shipped recipe trained on every GPU row of {', '.join(SOURCES)} outside the frozen "
        f"benchmark except {device}'s ({base_rows['train']} training rows). Then one `layercast retrain` "
        f"(run {result['id']}, its defaults, GPU rows of the imported sources): it found {tuning['hardware_ids']} "
        f"new to production and {'fine-tuned' if tuning['method'] == 'finetune' else 'trained'} the candidate "
        f"{result['candidate_version']} ({tuning['reason']}).", "",
        f"## The candidate and the gate: {result['status']}", "",
        f"On the {dev['candidate']['n']} {device} rows of the retrain's held-out split: production "
        f"{dev['production']['mape_pct']:.1f} % MAPE, the fine-tuned candidate {dev['candidate']['mape_pct']:.1f} %. "
        f"Overall (held-out split / frozen benchmark): production "
        f"{m['production']['held_out']['overall']['mape_pct']:.1f} / "
        f"{m['production']['benchmark']['overall']['mape_pct']:.1f} %, candidate "
        f"{m['candidate']['held_out']['overall']['mape_pct']:.1f} / "
        f"{m['candidate']['benchmark']['overall']['mape_pct']:.1f} %. Gate: {result['reason']} "
        f"({len(result['gate']['checks'])} checks, {len(failed)} failed).", "",
        "| split | group | rows | production MAPE % | candidate MAPE % | allowed % | passed |",
        "|---|---|---:|---:|---:|---:|---|",
        *[f"| {c['split']} | {c['group']} | {c['n']} | {c['production_mape_pct']:.2f} | "
          f"{c['candidate_mape_pct']:.2f} | {c['max_mape_pct']:.2f} | {'yes' if c['passed'] else '**no**'} |"
          for c in result["gate"]["checks"]],
        "",
        f"## Learning curve: the same fine-tune on k of the {curve['pool']} {device} training rows", "",
        f"Scored on the same {curve['held_out']} held-out {device} rows ({curve['repeats']} draws per k; k = 0 is "
        "production as it is; the lookup table answers each held-out row from the nearest of the same k rows).", "",
        new_hardware.markdown({device: curve}), "",
        f"Reproduce: `{reproduce}` ({wall_s:.0f} s).",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the experiment (module docstring); returns the exit code."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="t4", help="catalog id of the GPU production never sees (default t4)")
    p.add_argument("--database-url", default=f"sqlite:///{Path(tempfile.gettempdir()) / 'layercast-curve.db'}")
    p.add_argument("--skip-import", action="store_true")
    p.add_argument("--store", type=Path, default=None, help="artifact store (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "new_hardware_t4")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.time()
    if not a.skip_import:
        for dataset in ("justus", "neusight", "vidur"):
            if import_main([dataset, "--database-url", a.database_url]) != 0:
                return 1
    upgrade(a.database_url)
    cfg = RetrainConfig(sources=SOURCES, cpu=False, reported=False, seed=a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        store = a.store or Path(tmp)
        frac = cfg.benchmark_fraction

        def without_device(rows: TrainingRows) -> np.ndarray:
            return (rows.gpu != a.device) & ~in_benchmark(rows.config, frac)

        training = train_run(database_url=a.database_url, out_dir=store, epochs=int(DEFAULTS["epochs"]),
                             sample=dict(DEFAULT_SAMPLE), seed=a.seed, version=f"no-{a.device}", sources=SOURCES,
                             cpu=False, logo=False, write_current=False,
                             keep_rows=without_device)  # fmt: skip
        assert a.device not in training["training_hardware"]
        register_production(a.database_url, store, training)
        result = run_retrain(database_url=a.database_url, store_dir=store, cfg=cfg)
    wall_s = round(time.time() - t0, 1)
    reproduce = "python scripts/new_hardware_curve.py " + " ".join(sys.argv[1:] if argv is None else argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    saved = {"device": a.device, "base_training_rows": training["training_data"]["rows"], "retrain_run": result,
             "wall_time_s": wall_s, "reproduce": reproduce}  # fmt: skip
    a.out.with_suffix(".json").write_text(json.dumps(saved, indent=1, default=str) + "\n")
    text = report(a.device, result, training["training_data"]["rows"], wall_s, reproduce)
    a.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
