"""The new-hardware learning curve at full scale (issue 10 item 6): hold one real GPU out of training, then
fine-tune on 25, 50, 100 and 200 of its measurements and score on the rest (Syed & Srinivasan 2021).

Usage: ``python scripts/new_hardware_curve.py [--device t4] [--database-url URL] [--skip-import]
[--out reports/new_hardware_t4]`` (about 10 minutes on 2 cores; writes ``<out>.md`` and ``<out>.json``).

Steps, with the project's own code only:

1. import Justus, NeuSight and Vidur (``layercast import``; ``--skip-import`` when the database has them);
2. train the shipped recipe (:func:`app.training.train.run`, :data:`app.training.train.DEFAULTS`, the default
   per-file sampling, no leave-one-GPU-out) on every GPU row except ``--device``'s: the "production" that never
   saw that GPU;
3. :func:`app.training.new_hardware.learning_curve` on ``--device``'s stored rows (the default per-file sample
   of each of its files): 20 % of its configurations held out, the base model fine-tuned from its weights on
   nested draws of k rows (3 draws per k), 2,000 rows of the other GPUs replayed; the lookup table of the same
   k rows as the baseline, all on the same held-out rows. This is what ``layercast retrain`` records under
   ``metrics.new_hardware`` when such a device's measurements arrive.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import REPO_ROOT  # noqa: E402
from app.measurements.cli import main as import_main  # noqa: E402
from app.training import new_hardware  # noqa: E402
from app.training.dataset import load_from_database  # noqa: E402
from app.training.train import DEFAULT_SAMPLE, DEFAULTS, load_weights  # noqa: E402
from app.training.train import run as train_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the experiment (module docstring); returns the exit code."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="t4", help="catalog id of the GPU held out (default t4)")
    p.add_argument("--database-url", default=f"sqlite:///{Path(tempfile.gettempdir()) / 'layercast-curve.db'}")
    p.add_argument("--skip-import", action="store_true")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "new_hardware_t4")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.time()
    if not a.skip_import:
        for dataset in ("justus", "neusight", "vidur"):
            if import_main([dataset, "--database-url", a.database_url]) != 0:
                return 1
    sources = ("justus2018", "neusight", "vidur")
    with tempfile.TemporaryDirectory() as tmp:
        meta = train_run(database_url=a.database_url, out_dir=Path(tmp), epochs=int(DEFAULTS["epochs"]),
                         sample=dict(DEFAULT_SAMPLE), seed=a.seed, version="base", sources=sources, cpu=False,
                         logo=False, write_current=False, keep_rows=lambda rows: rows.gpu != a.device)  # fmt: skip
        recipe = meta["model"]["recipe"]
        base = load_weights(Path(tmp) / meta["weights_file"], feature_names=meta["feature_names"],
                            hidden=int(recipe["hidden"]), depth=int(recipe["depth"]))  # fmt: skip
    assert a.device not in meta["training_hardware"]
    device_rows = load_from_database(a.database_url, sources=sources, hardware_ids=(a.device,),
                                     sample_per_file=DEFAULT_SAMPLE["neusight"], seed=a.seed)  # fmt: skip
    others = load_from_database(a.database_url, sources=("neusight",), hardware_kinds=("gpu",),
                                sample_per_file=200, seed=a.seed + 1)  # fmt: skip
    others = others.subset(others.gpu != a.device)
    replay = others.subset(np.sort(np.random.default_rng(a.seed + 1).choice(
        len(others), min(new_hardware.REPLAY_ROWS, len(others)), replace=False)))  # fmt: skip
    curve = new_hardware.learning_curve(base, device_rows, replay, feature_names=meta["feature_names"], seed=a.seed)
    result = {"device": a.device, "base_training_hardware": sorted(meta["training_hardware"]),
              "base_training_rows": meta["training_data"]["rows"], "curve": curve,
              "wall_time_s": round(time.time() - t0, 1),
              "reproduce": "python scripts/new_hardware_curve.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# New hardware: {a.device} held out of training, then fine-tuned on k of its measurements", "",
             f"Base: the shipped recipe trained on every GPU row of {', '.join(sources)} except {a.device}'s "
             f"({result['base_training_rows']['train']} rows). Held out: {curve['held_out']} of the {curve['rows']} "
             f"stored {a.device} rows (20 % of its configurations; the other {curve['pool']} are the pool the k "
             f"rows are drawn from, {curve['repeats']} draws per k). Fine-tune: every member from the base "
             f"weights, {len(replay)} rows of the other GPUs replayed. MAPE of the p50 on the held-out rows.", "",
             new_hardware.markdown({a.device: curve}), "",
             f"Reproduce: `{result['reproduce']}` ({result['wall_time_s']:.0f} s)."]  # fmt: skip
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
