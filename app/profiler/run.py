"""The profiling campaign (``layercast profile``): measure sampled layer configurations into a shard file.

``layercast profile ARGS...`` is :func:`main` ``(ARGS)``; the dataset committed under ``data/seed/`` was
made with it (see ``data/seed/README.md`` for the exact commands).

Usage::

    python -m app.profiler.run --out data/seed/layers_cpu.jsonl --n-configs 6000 --threads 1 \\
        --precision fp32,bf16 --bf16-fraction 0.15 --seed 0 --max-seconds 1.5
    python -m app.profiler.run e2e ...      # whole training iterations (see app.profiler.e2e)
    layercast profile --device cuda --out layers_h200.jsonl --upload http://layercast:8000 --hardware-id h200-sxm \\
        --api-key "$LAYERCAST_API_KEY"

``--upload URL`` posts the shard's rows to a running service once the campaign is done
(:mod:`app.profiler.upload`: batches with idempotency keys, so rerunning it stores nothing twice).

One JSON line per (configuration, precision) is appended to ``--out`` and flushed as soon as it is
measured, so an interrupted campaign (Ctrl-C, SIGTERM, a crash) loses at most the configuration in
flight: rerunning the same command skips every ``(config_id, precision)`` already in the file (rows
with ``status == "error"`` included; delete those lines to retry them). The list of configurations is
a deterministic function of ``--seed``, ``--families``, ``--n-configs`` and ``--max-train-ms``
(:func:`app.profiler.sampler.sample_configs`; raising ``--n-configs`` extends the same list).

Row format (``schema`` 1; times in milliseconds)::

    config_id, family, op, op_kind, origin   what was measured (config_id: stable hash of the layer)
    batch_size, input_shape, graph, shapes   the layer: ``import_json(graph, batch_size=batch_size)``
                                             rebuilds it (graph is None for matmul/attention: ``shapes``)
    needs_input_grad, optimizer, precision   measurement conditions (optimizer "none": no parameters)
    status, error                            "ok" | "error" and the exception text
    timings.{forward, train_forward, backward, update, train_step, backward_input, backward_weight}
            .{median_ms, q1_ms, q3_ms, min_ms, max_ms, mean_ms, std_ms, n}
    forward_ms, train_step_ms                the two medians, for convenience
    params, forward_flops                    analytical (app.core.costs) for quick checks
    measure.{warmup, reps, min_reps, budget_s, split_backward}
    measured_at (ISO 8601 UTC), load_avg_1m (host load when measured), wall_s (time spent on the row)
    context.{device, device_name, cpu_model, logical_cpus, threads, framework, framework_version, ...}

``--refine-from FILE``: rows of the format above (e.g. a held-out evaluation dump) carrying an
``error`` number (larger = worse prediction, e.g. ``|ln(pred/measured)|``); the campaign then also
measures ``--n-refine`` neighbours of the worst of them (:func:`app.profiler.sampler.propose_neighbours`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from app.profiler import ROW_SCHEMA, iter_rows
from app.profiler.sampler import (
    DEFAULT_MAX_TRAIN_MS,
    FAMILY_WEIGHTS,
    LayerConfig,
    propose_neighbours,
    sample_configs,
)
from app.progress import bar
from app.progress import enabled as progress_enabled


def _fraction_pick(config_id: str, salt: str, fraction: float) -> bool:
    """Deterministic pseudo-random subset: True for about ``fraction`` of ids."""
    h = int(hashlib.sha1(f"{salt}:{config_id}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def done_keys(path: Path) -> set[tuple[str, str]]:
    """``(config_id, precision)`` of every row already in ``path`` (empty if it does not exist)."""
    if not path.exists():
        return set()
    return {(r["config_id"], r["precision"]) for r in iter_rows(path) if "config_id" in r and "precision" in r}


def _open_for_append(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:  # a killed writer may have left a partial last line
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
        if last != b"\n":
            with open(path, "ab") as fh:
                fh.write(b"\n")
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the caller


def _analytic(config: LayerConfig) -> tuple[int, int]:
    from app.core.costs import layer_cost

    layers = config.to_layers()
    return sum(la.params for la in layers), sum(layer_cost(la).forward_flops for la in layers)


def _load_refine(path: Path, n: int, seed: int, max_train_ms: float, exclude: set[str]) -> list[LayerConfig]:
    pairs = []
    for row in iter_rows(path):
        if isinstance(row.get("error"), int | float):
            try:
                pairs.append((LayerConfig.from_row(row), float(row["error"])))
            except (KeyError, TypeError, ValueError):
                continue
    return propose_neighbours(pairs, n=n, seed=seed, max_train_ms=max_train_ms, exclude=exclude)


class Progress:
    """Progress of a campaign on stderr: a tqdm bar with ETA where bars are shown (:mod:`app.progress`: a
    terminal, or ``LAYERCAST_PROGRESS=1``), otherwise a plain line every ``every_s`` seconds (log files,
    e.g. under nohup)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, every_s: float = 15.0) -> None:
        self.total, self.stream = total, stream or sys.stderr
        self.bar = bar(desc="profile", total=total, unit="meas") if progress_enabled() else None
        self.every_s = every_s
        self.t0 = time.monotonic()
        self.last = 0.0
        self.done = self.ok = self.err = self.skipped = 0

    def update(self, *, status: str, label: str, force: bool = False) -> None:
        self.done += 1
        if status == "ok":
            self.ok += 1
        elif status == "error":
            self.err += 1
        else:
            self.skipped += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"ok {self.ok} err {self.err} skipped {self.skipped} {label}", refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if not force and now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        el = now - self.t0
        measured = self.ok + self.err
        rate = el / measured if measured else 0.0
        eta = rate * (self.total - self.done)
        self.stream.write(f"[{self.done:>6}/{self.total}] {100 * self.done / max(1, self.total):5.1f}%  ok {self.ok}"
                          f"  err {self.err}  skipped {self.skipped}  {label:<28.28}  elapsed {_hms(el)}  "
                          f"eta {_hms(eta)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layercast profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("data/seed/layers_cpu.jsonl"),
                   help="JSONL shard to append to (resumed if it exists; gzip it when the campaign is done)")
    p.add_argument("--n-configs", type=int, default=6000, help="distinct configurations to sample")
    p.add_argument("--families", default="all",
                   help=f"comma-separated subset of: {','.join(FAMILY_WEIGHTS)} (default all)")
    p.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    p.add_argument("--bf16-fraction", type=float, default=0.15,
                   help="share of configurations also measured in bf16/fp16 (deterministic subset)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (recorded in every row)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--max-seconds", type=float, default=1.5, help="wall-clock budget per configuration")
    p.add_argument("--max-train-ms", type=float, default=DEFAULT_MAX_TRAIN_MS,
                   help="cap on a configuration's estimated training step (sampler shrinks batch/shape)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--split-backward-fraction", type=float, default=0.2,
                   help="share of configurations whose backward is also split into input/weight gradients")
    p.add_argument("--time-limit", type=float, default=None, help="stop (resumably) after this many seconds")
    p.add_argument("--refine-from", type=Path, default=None,
                   help="rows with an 'error' field: also measure neighbours of the worst-predicted ones")
    p.add_argument("--n-refine", type=int, default=500)
    p.add_argument("--limit", type=int, default=None, help="measure only the first N pending configs (tests)")
    p.add_argument("--upload", metavar="URL", default=None,
                   help="when the campaign is done, post the shard's rows to the layercast service at URL")
    p.add_argument("--hardware-id", default=None,
                   help="id of this device on the server (required with --upload): a catalog id, or for a CPU "
                        "the id of the hardware.json written beside --out once added there (POST /v1/hardware); "
                        "'local' only when the server runs on this machine")
    p.add_argument("--api-key", default=None,
                   help="API key with the 'measurements' scope for --upload (default $LAYERCAST_API_KEY; "
                        "`layercast keys create NAME --scope measurements`)")
    return p


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"device {device!r} requested but torch.cuda.is_available() is False")
    return device


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the campaign (or ``e2e`` when the first argument is ``e2e``); returns the exit status
    (0 done, 130 interrupted — rerun the same command to resume)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "e2e":
        from app.profiler.e2e import main as e2e_main

        return e2e_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.upload is not None and not args.hardware_id:
        raise SystemExit("--upload needs --hardware-id (the device's catalog id on the server)")
    if str(args.out).endswith(".gz"):
        raise SystemExit("--out must be a plain .jsonl (appended row by row); gzip it when the campaign is done")
    families = None if args.families == "all" else [f.strip() for f in args.families.split(",") if f.strip()]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    for prec in precisions:
        if prec not in ("fp32", "bf16", "fp16"):
            raise SystemExit(f"unknown precision {prec!r}")

    import torch

    from app.profiler.timing import bf16_supported, device_context, make_clock, measure_config, record_machine

    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # already set: the inter-op pool has started
        torch.set_num_interop_threads(1)
    device = _resolve_device(args.device)
    clock = make_clock(device)
    ctx = device_context(device)
    ctx["campaign_seed"] = args.seed
    record_machine(args.out.parent, ctx)
    low_ok = {"fp32": True, "bf16": ctx["bf16_supported"] or device == "cpu",
              "fp16": device.startswith("cuda")}
    if "bf16" in precisions and not bf16_supported(device):
        print("note: bf16 is not native on this device (measured anyway, emulated)", file=sys.stderr)

    print(f"sampling {args.n_configs} configurations (seed {args.seed})...", file=sys.stderr)
    configs = sample_configs(args.n_configs, seed=args.seed, families=families, max_train_ms=args.max_train_ms)
    if args.refine_from is not None:
        configs += _load_refine(args.refine_from, args.n_refine, args.seed, args.max_train_ms,
                                {c.config_id for c in configs})
    work: list[tuple[LayerConfig, str]] = []
    for c in configs:
        for prec in precisions:
            if prec == "fp32" or (low_ok[prec] and _fraction_pick(c.config_id, "lowp", args.bf16_fraction)):
                work.append((c, prec))
    done = done_keys(args.out)
    pending = [(c, p) for c, p in work if (c.config_id, p) not in done]
    if args.limit is not None:
        pending = pending[: args.limit]
    print(f"{len(work)} measurements planned, {len(work) - len(pending)} already in {args.out}, "
          f"{len(pending)} to go; device {ctx['device_name']} ({device}), {ctx['threads']} thread(s)",
          file=sys.stderr)

    prev = signal.signal(signal.SIGTERM, _on_sigterm)
    progress = Progress(len(pending))
    t_start = time.monotonic()
    fh = _open_for_append(args.out)
    try:
        for i, (cfg, prec) in enumerate(pending):
            if args.time_limit is not None and time.monotonic() - t_start > args.time_limit:
                print(f"\ntime limit reached after {i} measurements; rerun to resume", file=sys.stderr)
                break
            split = _fraction_pick(cfg.config_id, "split", args.split_backward_fraction)
            t0 = time.perf_counter()
            row: dict[str, Any] = {"schema": ROW_SCHEMA, **cfg.row_fields(prec), "precision": prec}
            try:
                params, flops = _analytic(cfg)
                timings = measure_config(cfg, precision=prec, device=device, clock=clock, warmup=args.warmup,
                                         reps=args.reps, min_reps=args.min_reps, budget_s=args.max_seconds,
                                         split_backward=split)
                row.update(status="ok", error=None,
                           timings={k: v.to_dict() for k, v in timings.items()},
                           forward_ms=timings["forward"].to_dict()["median_ms"],
                           train_step_ms=timings["train_step"].to_dict()["median_ms"])
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # recorded, the campaign goes on
                params, flops = 0, 0
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500], timings={},
                           forward_ms=None, train_step_ms=None)
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            row.update(
                params=params, forward_flops=flops,
                measure={"warmup": args.warmup, "reps": args.reps, "min_reps": args.min_reps,
                         "budget_s": args.max_seconds, "split_backward": split},
                measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
                load_avg_1m=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
                wall_s=round(time.perf_counter() - t0, 3),
                context=ctx,
            )
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
            fh.flush()
            progress.update(status=row["status"], label=f"{cfg.family}/{prec}")
            if i % 200 == 199:
                gc.collect()
    except KeyboardInterrupt:
        progress.close()
        fh.close()
        print(f"interrupted: {progress.ok + progress.err} rows written to {args.out}; "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, prev)
        if not fh.closed:
            fh.close()
    progress.close()
    print(f"done: {progress.ok} ok, {progress.err} errors -> {args.out}", file=sys.stderr)
    if args.upload is None:
        return 0
    if not {(c.config_id, p) for c, p in work} <= done_keys(args.out):
        print(f"not uploading: the campaign in {args.out} is not finished (rerun to resume; it uploads at the end)",
              file=sys.stderr)
        return 0
    return _upload(args.out, server=args.upload, hardware_id=args.hardware_id, api_key=args.api_key)


def _upload(path: Path, *, server: str, hardware_id: str, api_key: str | None) -> int:
    """Post the finished shard (:func:`app.profiler.upload.upload_shard`); exit status 0 or 1 (refused)."""
    from app.client import LayercastAPIError
    from app.profiler.upload import http_client, upload_shard

    with http_client(server, api_key=api_key) as client:
        try:
            upload_shard(path, client=client, hardware_id=hardware_id, log=lambda s: print(s, file=sys.stderr))
        except LayercastAPIError as exc:
            print(f"upload refused: {exc} {exc.detail}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
