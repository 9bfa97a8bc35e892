"""``layercast predict | compare | gate``: cost predictions for CI pipelines, offline or against a server.

Offline (the default) the command runs the same code the API runs, in process, without a database: the
ONNX file is imported by :func:`app.graphs.service.build_graph`, the device comes from the built-in
catalog (:func:`app.hardware.catalog.load_catalog`) and the predictor from ``$LAYERCAST_MODELS_DIR``
(:func:`app.predictor.registry.load_predictor`); the answer is :func:`app.predictions.service.estimate`'s.
With ``--server URL`` the file is uploaded to ``POST /v1/graphs`` and predicted by ``POST /v1/predictions``
(``compare``: one ``POST /v1/comparisons`` for all devices) through httpx, so a pipeline can share one service
and its custom hardware. ``compare`` answers the comparison's rows either way (job time, cost, energy, fit,
Pareto front: :func:`app.estimates.service.mark_pareto`), so it needs ``--dataset-size`` and ``--epochs``.

Exit codes: 0 success (gate: within every limit), 1 gate breach, 2 bad arguments or a prediction the
service refused (unknown hardware, unsupported precision, unreadable model: the problem document's code
is printed; ``compare``: no row at all, or a ``--hardware`` id that names no device, after the table),
3 ``--server`` unreachable or not a URL (connection refused, unknown host, no ``http://``, a timeout, an
answer that is not the service's JSON, a 5xx: one line, never a traceback, and never 1 so a CI job cannot
read an outage as a breach), 4 gate: the candidate has layers that cannot be costed (unsupported
ops, left out of every total, so a limit would be checked against an undercount; ``--allow-unsupported``
gates the costed layers only).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from app.core.precision import Precision
from app.errors import LayercastError

EXIT_OK, EXIT_BREACH, EXIT_ERROR, EXIT_UNREACHABLE, EXIT_UNSUPPORTED = 0, 1, 2, 3, 4

EXIT_CODES_HELP = """exit codes:
  0  ok (gate: within every limit)
  1  gate: a limit breached
  2  bad arguments, or a prediction the service refused (its error code is printed)
  3  --server unreachable, not a valid URL or answering 5xx (nothing was predicted)
  4  gate: the candidate has layers that cannot be costed (see --allow-unsupported)
141  the output pipe closed early (| head): stopped quietly, as a SIGPIPE'd command"""


class ServerUnreachable(Exception):
    """``--server`` could not be asked: a transport error (refused, unknown host, timeout), a URL httpx
    cannot use, an answer that is not the service's JSON, or a 5xx (the service, or a proxy in front of it,
    cannot answer now: no verdict on the model)."""


class PredictionFailed(Exception):
    """A prediction the backend refused: ``code`` is the problem document's machine-readable code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class JobParams:
    """What to predict besides the model and the device (units in the names; ``None`` = not asked)."""

    batch_size: int
    mode: str = "training"
    optimizer: str = "sgd"
    precision: str = "fp32"
    dataset_size: int | None = None
    epochs: float | None = None
    device_count: int = 1
    nodes: int = 1
    price_usd_per_hour: float | None = None
    dims: tuple[tuple[str, int], ...] = ()

    def body(self) -> dict[str, Any]:
        """The job part of a ``POST /v1/predictions`` body (``batch_size`` is the global batch)."""
        body: dict[str, Any] = {"batch_size": self.batch_size, "mode": self.mode, "optimizer": self.optimizer,
                                "precision": self.precision, "dims": dict(self.dims),
                                "device_count": self.device_count, "nodes": self.nodes}
        for key in ("dataset_size", "epochs", "price_usd_per_hour"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


class Backend(Protocol):
    """Where predictions come from; ``predict`` returns a ``PredictionRead`` and ``compare`` a
    ``ComparisonRead`` (``rows``, ``unavailable``, ``predictor_version``) as JSON-ready dicts."""

    def predict(self, model: Path, hardware_id: str, params: JobParams) -> dict[str, Any]: ...

    def compare(self, model: Path, hardware_ids: Sequence[str], params: JobParams) -> dict[str, Any]: ...


def _comparison_row(pred: dict[str, Any]) -> Any:
    """A ``PredictionRead`` dict with an epoch and a job as the ``ComparisonRow`` the API would answer."""
    from app.estimates.schemas import ComparisonRow

    it, job, memory = pred["iteration"], pred["job"], pred["memory"]
    return ComparisonRow(
        hardware_id=pred["hardware_id"], device_count=it["device_count"], nodes=it["nodes"],
        per_device_batch_size=it["per_device_batch_size"], iteration_ms=it["time_ms"],
        iteration_ms_p90=it["time_ms_p90"], samples_per_s=it["samples_per_s"],
        scaling_efficiency=it["scaling_efficiency"], allreduce_exposed_ms=it["allreduce_exposed_ms"],
        epoch_s=pred["epoch"]["time_s"], job_s=job["time_s"], job_s_p90=job["time_s_p90"], cost_usd=job["cost_usd"],
        energy_j=job["energy_j"], co2_kg=job["co2_kg"], peak_memory_bytes=memory["total_bytes"], fits=memory["fits"],
        largest_batch_size_that_fits=memory["largest_batch_size_that_fits"], pareto=False)


class OfflineBackend:
    """In process: the API's pure prediction path over the built-in catalog and the shipped predictor."""

    def __init__(self, models_dir: Path) -> None:
        from app.hardware.catalog import load_catalog
        from app.predictor.registry import load_predictor

        self.catalog = load_catalog()
        self.predictor = load_predictor(models_dir)

    def predict(self, model: Path, hardware_id: str, params: JobParams) -> dict[str, Any]:
        """Raises :class:`PredictionFailed` with the API's error code for what the API would refuse."""
        from app.core.analysis import analyze
        from app.graphs import service as graphs
        from app.hardware.local import LOCAL_ID
        from app.predictions.schemas import PredictionCreate
        from app.predictions.service import check_costed, estimate

        hw = self.catalog.get(hardware_id)
        if hw is None and hardware_id == LOCAL_ID:  # the one non-catalog id a user may expect to work offline
            raise PredictionFailed(
                "hardware_not_found",
                f"{LOCAL_ID!r} (this machine's CPU) is detected and its memory bandwidth measured by the service at "
                "startup, not offline: start it (`layercast serve`) and pass --server URL")
        if hw is None:
            raise PredictionFailed(
                "hardware_not_found",
                f"unknown hardware id {hardware_id!r} (offline: built-in catalog only; see `layercast hardware "
                "list`, or use --server for custom hardware)")
        content = model.read_bytes()
        try:
            request = PredictionCreate(graph_id=graphs.content_id(content), hardware_id=hardware_id,
                                       **params.body())
        except ValidationError as exc:  # what the API answers with a 422: each field and why, as the API says it
            where = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise PredictionFailed("validation_error", where) from exc
        try:
            graph = graphs.build_graph(content, "onnx", batch_size=request.per_device_batch_size,
                                       dims=dict(params.dims), name=model.stem)
            analysis = analyze(graph, software_stack=request.software_stack, hardware_kind=hw.kind)
            check_costed(analysis, None)  # as the API: never a 0 s answer
            answer = estimate(analysis, hw, self.predictor, request=request, graph_id=None)
        except LayercastError as exc:
            raise PredictionFailed(exc.code, exc.message) from exc
        return answer.model_dump(mode="json")

    def compare(self, model: Path, hardware_ids: Sequence[str], params: JobParams) -> dict[str, Any]:
        """The ``POST /v1/comparisons`` answer computed in process (rows sorted by job time, Pareto marked);
        devices that cannot run the job are in ``unavailable`` with their code."""
        from app.estimates.service import mark_pareto

        rows, unavailable = [], []
        for hw in hardware_ids:
            try:
                rows.append(_comparison_row(self.predict(model, hw, params)))
            except PredictionFailed as exc:
                unavailable.append({"hardware_id": hw, "device_count": params.device_count, "code": exc.code,
                                    "reason": exc.message})
        mark_pareto(rows)
        rows.sort(key=lambda r: (r.job_s, r.hardware_id))
        return {"predictor_version": self.predictor.version, "rows": [r.model_dump(mode="json") for r in rows],
                "unavailable": unavailable}


class ServerBackend:
    """Against a running service: upload to ``POST /v1/graphs`` (once per file), ``POST /v1/predictions``."""

    def __init__(self, url: str, *, timeout_s: float = 120.0) -> None:
        import httpx

        self.url = url
        try:
            self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        except httpx.InvalidURL as exc:
            raise ServerUnreachable(f"--server {url!r} is not a valid URL: {exc}") from exc
        self._ids: dict[Path, str] = {}

    def _post(self, path: str, **kwargs: Any) -> Any:
        """``client.post`` with httpx's transport and URL errors as :class:`ServerUnreachable`."""
        import httpx

        try:
            return self.client.post(path, **kwargs)
        except (httpx.RequestError, httpx.InvalidURL) as exc:
            raise ServerUnreachable(f"cannot reach --server {self.url!r} ({type(exc).__name__}: {exc})") from exc

    def _check(self, response: Any) -> dict[str, Any]:
        is_json = response.headers.get("content-type", "").startswith("application/json")
        try:
            body = response.json() if is_json else {}
        except ValueError:
            is_json = False
        err = body.get("error") if is_json and isinstance(body, dict) else None
        if response.status_code >= 400 and (response.status_code >= 500 or not isinstance(err, dict)):
            # the service cannot answer now (503 not_ready, database_unavailable, import_worker_failed), or a
            # proxy in front of it answered (502/504 HTML): no verdict on the model, so not exit 2 (refused)
            detail = f"{err.get('code')}: {err.get('message')}" if isinstance(err, dict) else response.text[:200]
            raise ServerUnreachable(f"--server {self.url!r} answered {response.status_code} ({detail})")
        if response.status_code >= 400:
            assert isinstance(err, dict)
            raise PredictionFailed(str(err.get("code", f"http_{response.status_code}")),
                                   str(err.get("message", response.text[:200])))
        if not is_json or not isinstance(body, dict):
            raise ServerUnreachable(f"--server {self.url!r} answered {response.status_code} without the service's "
                                    "JSON: is it a layercast server?")
        return dict(body)

    def graph_id(self, model: Path, dims: tuple[tuple[str, int], ...] = ()) -> str:
        """Id of ``model`` on the server (uploaded on first use, with the request's ``dims``: a graph with a
        symbolic dimension besides the batch cannot be uploaded without them, ``unbound_dimension``; they bind
        the upload's summary only, and the id is the content's hash whatever they are)."""
        if model not in self._ids:
            query = {"dims": ",".join(f"{k}={v}" for k, v in dims)} if dims else {}
            with model.open("rb") as fh:
                files = {"file": (model.name, fh, "application/octet-stream")}
                self._ids[model] = str(self._check(self._post("/v1/graphs", files=files, params=query))["id"])
        return self._ids[model]

    def predict(self, model: Path, hardware_id: str, params: JobParams) -> dict[str, Any]:
        """Raises :class:`PredictionFailed` with the server's error code on a 4xx/5xx answer."""
        body = {"graph_id": self.graph_id(model, params.dims), "hardware_id": hardware_id, **params.body()}
        return self._check(self._post("/v1/predictions", json=body))

    def compare(self, model: Path, hardware_ids: Sequence[str], params: JobParams) -> dict[str, Any]:
        """One ``POST /v1/comparisons`` for every device; raises :class:`PredictionFailed` on a 4xx/5xx."""
        job = params.body()
        body: dict[str, Any] = {
            "graph_id": self.graph_id(model, params.dims), "hardware_ids": list(hardware_ids),
            "device_counts": [job.pop("device_count")], **job}
        nodes = body.pop("nodes")
        if nodes > 1:  # a comparison spreads its counts over nodes of devices_per_node
            body["devices_per_node"] = params.device_count // nodes
        price = body.pop("price_usd_per_hour", None)
        if price is not None:
            body["price_usd_per_hour"] = dict.fromkeys(hardware_ids, price)
        return self._check(self._post("/v1/comparisons", json=body))


# ---------------------------------------------------------------------------------------------- metrics


def headline(pred: dict[str, Any]) -> tuple[str, float]:
    """The job-level figure a gate compares: job seconds when epochs were given, else epoch seconds when
    a dataset size was, else iteration milliseconds."""
    if pred.get("job"):
        return "job_s", float(pred["job"]["time_s"])
    if pred.get("epoch"):
        return "epoch_s", float(pred["epoch"]["time_s"])
    return "iteration_ms", float(pred["iteration"]["time_ms"])


@dataclass(frozen=True, slots=True)
class LayerDelta:
    """One layer's time in the baseline and the candidate (ms per iteration; None when absent)."""

    name: str
    op_type: str
    baseline_ms: float | None
    candidate_ms: float | None

    @property
    def delta_ms(self) -> float:
        """Growth in ms per iteration (a new layer grows from 0, a removed one shrinks to 0)."""
        return (self.candidate_ms or 0.0) - (self.baseline_ms or 0.0)


def layer_deltas(baseline: dict[str, Any], candidate: dict[str, Any]) -> list[LayerDelta]:
    """Per-layer time changes matched by layer name, largest growth first. Unsupported layers (no time)
    count as absent."""
    def times(pred: dict[str, Any]) -> dict[str, tuple[str, float]]:
        out: dict[str, tuple[str, float]] = {}
        for row in pred["layers"]:
            if row["total_ms"] is not None:
                op, t = out.get(row["name"], (row["op_type"], 0.0))
                out[row["name"]] = (op, t + float(row["total_ms"]))
        return out

    old, new = times(baseline), times(candidate)
    deltas = [
        LayerDelta(name, (new.get(name) or old[name])[0], old[name][1] if name in old else None,
                   new[name][1] if name in new else None)
        for name in list(new) + [n for n in old if n not in new]
    ]
    return sorted(deltas, key=lambda d: -d.delta_ms)


def parse_fraction(text: str) -> float:
    """``"5%"`` → 0.05, ``"0.05"`` → 0.05; raises ``argparse.ArgumentTypeError`` for anything else, and for a
    bare number of 1 or more (``--max-increase 5`` read as 500 %, a gate that never fires for someone who
    meant 5 %: write ``5%``, or ``500%`` for 500 %)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a fraction like 5% or 0.05, got {text!r}")
    value = float(m.group(1))
    if not m.group(2) and value >= 1:
        raise argparse.ArgumentTypeError(
            f"{text.strip()!r} without '%' would be {value * 100:g} %; write {text.strip()}% for "
            f"{text.strip()} %, or a fraction below 1 such as 0.05")
    return value / 100 if m.group(2) else value


def _dims(text: str) -> tuple[tuple[str, int], ...]:
    from app.graphs.router import parse_dims

    try:
        return tuple(sorted(parse_dims(text).items()))
    except LayercastError as exc:
        raise argparse.ArgumentTypeError(exc.message) from exc


# ---------------------------------------------------------------------------------------------- output


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _summary_row(hw: str, pred: dict[str, Any]) -> dict[str, Any]:
    return {
        "hardware_id": hw,
        "iteration_ms": pred["iteration"]["time_ms"],
        "iteration_ms_p90": pred["iteration"]["time_ms_p90"],
        "epoch_s": (pred.get("epoch") or {}).get("time_s"),
        "job_s": (pred.get("job") or {}).get("time_s"),
        "cost_usd": (pred.get("job") or {}).get("cost_usd"),
        "energy_j": (pred.get("job") or {}).get("energy_j"),
        "device_count": pred["iteration"]["device_count"],
        "scaling_efficiency": pred["iteration"]["scaling_efficiency"],
        "peak_memory_bytes": pred["memory"]["total_bytes"],
        "fits": pred["memory"]["fits"],
        "largest_batch_size_that_fits": pred["memory"]["largest_batch_size_that_fits"],
        "predictor_version": pred["predictor_version"],
    }


def _print_rows(rows: Sequence[dict[str, Any]], *, comparison: bool) -> None:
    """The rows as a table. A ``comparison`` (``compare``) prints every column; a single prediction
    (``predict``) leaves out the columns its answer has no value for: ``pareto`` and ``error`` always (one
    device, no front, refusals exit 2), ``epoch_s``, ``job_s``, ``cost_usd``, ``energy_kwh`` when no job was
    asked for with ``--dataset-size``/``--epochs``."""
    from app.cli import format_table

    headers: tuple[str, ...] = ("hardware_id", "devices", "iteration_ms", "epoch_s", "job_s", "cost_usd",
                                "energy_kwh", "peak_gib", "fits", "largest_batch", "pareto", "error")
    table: list[tuple[Any, ...]] = [
        (r["hardware_id"], r.get("device_count"), r.get("iteration_ms"), r.get("epoch_s"), r.get("job_s"),
         r.get("cost_usd"), None if r.get("energy_j") is None else r["energy_j"] / 3.6e6,
         None if r.get("peak_memory_bytes") is None else r["peak_memory_bytes"] / 2**30, r.get("fits"),
         r.get("largest_batch_size_that_fits"), r.get("pareto"), r.get("error"))
        for r in rows
    ]
    if not comparison:
        kept = [j for j in range(len(headers)) if any(row[j] is not None for row in table)]
        headers, table = tuple(headers[j] for j in kept), [tuple(row[j] for j in kept) for row in table]
    print(format_table(table, headers))


# ---------------------------------------------------------------------------------------------- commands


def add_parsers(sub: Any) -> None:
    """Register ``predict``, ``compare`` and ``gate`` on the ``layercast`` subparsers."""
    def common(p: argparse.ArgumentParser, *, hardware_help: str) -> None:
        p.add_argument("model", type=Path, help="ONNX file")
        p.add_argument("--hardware", required=True, help=hardware_help)
        p.add_argument("--batch-size", type=int, required=True, help="samples per iteration")
        p.add_argument("--dataset-size", type=int, default=None, help="samples per epoch")
        p.add_argument("--epochs", type=float, default=None, help="epochs of the job (needs --dataset-size)")
        p.add_argument("--device-count", type=int, default=1,
                       help="data-parallel devices sharing --batch-size (the global batch)")
        p.add_argument("--nodes", type=int, default=1,
                       help="nodes the --device-count devices sit on, evenly, at most 8 per node (default 1)")
        p.add_argument("--price-usd-per-hour", type=float, default=None,
                       help="price per device-hour (default: the catalog's list price; needs --epochs)")
        p.add_argument("--precision", default="fp32", choices=[x.value for x in Precision])
        p.add_argument("--mode", default="training", choices=["training", "inference"])
        p.add_argument("--optimizer", default="sgd")
        p.add_argument("--dims", type=_dims, default=(), help="symbolic dimensions, e.g. seq=128")
        p.add_argument("--server", default=None, help="service URL (default: predict offline, in process)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def parser(name: str, help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_, epilog=EXIT_CODES_HELP,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        return p

    predict = parser("predict", "predict a model's iteration, epoch and job time on one device")
    common(predict, hardware_help="hardware id (see `layercast hardware list`)")

    compare = parser("compare", "one job on several devices: time, cost, energy, Pareto front "
                                "(needs --dataset-size and --epochs)")
    common(compare, hardware_help="comma-separated hardware ids, e.g. v100-sxm2-16gb,a100-sxm4-40gb")

    gate = parser("gate", "fail (exit 1) when a model's predicted cost breaches a limit "
                          "(exit 4 when it has layers that cannot be costed)")
    common(gate, hardware_help="hardware id the limit applies to")
    limits = gate.add_argument_group("limits (at least one)")
    limits.add_argument("--baseline", type=Path, default=None, help="ONNX file of the previous model")
    limits.add_argument("--max-increase", type=parse_fraction, default=None,
                        help="largest allowed growth over --baseline, e.g. 5%%")
    limits.add_argument("--max-epoch-s", type=float, default=None, help="largest allowed epoch time (s)")
    limits.add_argument("--max-usd", type=float, default=None,
                        help="largest allowed job cost (USD; needs --dataset-size and --epochs)")
    gate.add_argument("--top", type=int, default=10, help="layers to list (default 10)")
    gate.add_argument("--allow-unsupported", action="store_true",
                      help="pass a candidate with layers that cannot be costed (default: exit 4 naming them; "
                           "their time is left out of every total)")


def _params(args: argparse.Namespace) -> JobParams:
    return JobParams(batch_size=args.batch_size, mode=args.mode, optimizer=args.optimizer,
                     precision=args.precision, dataset_size=args.dataset_size, epochs=args.epochs,
                     device_count=args.device_count, nodes=args.nodes, price_usd_per_hour=args.price_usd_per_hour,
                     dims=args.dims)


def _backend(args: argparse.Namespace) -> Backend:
    if args.server:
        return ServerBackend(args.server)
    from app.config import Settings

    return OfflineBackend(Settings().models_dir)


def _predict(args: argparse.Namespace, backend: Backend) -> int:
    pred = backend.predict(args.model, args.hardware, _params(args))
    if args.json:
        print(json.dumps(pred, indent=2))
        return EXIT_OK
    _print_rows([_summary_row(args.hardware, pred)], comparison=False)
    for warning in pred["warnings"]:
        print(f"warning: {warning}")
    return EXIT_OK


def _compare(args: argparse.Namespace, backend: Backend) -> int:
    if args.dataset_size is None or args.epochs is None:
        print("layercast compare: give --dataset-size and --epochs (rows are whole jobs: time, cost, energy)",
              file=sys.stderr)
        return EXIT_ERROR
    hardware_ids = list(dict.fromkeys(h.strip() for h in args.hardware.split(",") if h.strip()))
    if not hardware_ids:
        print(f"layercast compare: --hardware {args.hardware!r} names no device: give comma-separated ids "
              "(`layercast hardware list`)", file=sys.stderr)
        return EXIT_ERROR
    answer = backend.compare(args.model, hardware_ids, _params(args))
    rows: list[dict[str, Any]] = [dict(r) for r in answer["rows"]]
    # a device that cannot run the job is listed with its reason, not dropped
    rows += [{"hardware_id": u["hardware_id"], "device_count": u["device_count"], "error": u["code"],
              "message": u["reason"]} for u in answer["unavailable"]]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_rows(rows, comparison=True)
        print(f"predictor {answer['predictor_version']}; pareto: not dominated in job time, cost and energy")
    # a device that cannot run the job is an answer; an id that names no device is a typo a pipeline must see
    unknown = [u["hardware_id"] for u in answer["unavailable"] if u["code"] == "hardware_not_found"]
    if unknown:
        print(f"layercast compare: hardware_not_found: {', '.join(map(repr, unknown))} (see `layercast hardware "
              "list`)", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK if answer["rows"] else EXIT_ERROR


def _gate(args: argparse.Namespace, backend: Backend) -> int:
    if args.max_increase is None and args.max_epoch_s is None and args.max_usd is None:
        print("layercast gate: give --max-increase (with --baseline), --max-epoch-s and/or --max-usd",
              file=sys.stderr)
        return EXIT_ERROR
    if args.max_usd is not None and args.epochs is None:
        print("layercast gate: --max-usd needs --dataset-size and --epochs", file=sys.stderr)
        return EXIT_ERROR
    if (args.max_increase is None) != (args.baseline is None):
        print("layercast gate: --max-increase and --baseline go together", file=sys.stderr)
        return EXIT_ERROR
    if args.max_epoch_s is not None and args.dataset_size is None:
        print("layercast gate: --max-epoch-s needs --dataset-size", file=sys.stderr)
        return EXIT_ERROR
    params = _params(args)
    candidate = backend.predict(args.model, args.hardware, params)
    metric, value = headline(candidate)
    uncosted = uncosted_line(candidate)
    base_uncosted: str | None = None  # a baseline's uncosted layers make its total, and so the growth, wrong
    warnings = [str(w) for w in candidate["warnings"]]
    breaches: list[str] = []
    checks: list[dict[str, Any]] = []
    deltas: list[LayerDelta] = []
    if args.baseline is not None:
        baseline = backend.predict(args.baseline, args.hardware, params)
        base_uncosted = uncosted_line(baseline)
        _, base_value = headline(baseline)
        warnings += [f"baseline: {w}" for w in baseline["warnings"]]
        growth = value / base_value - 1 if base_value > 0 else float("inf")
        ok = growth <= args.max_increase
        # against a baseline whose total leaves layers out, the growth is no verdict (exit 4 below, not 1)
        judged = base_uncosted is None or args.allow_unsupported
        checks.append({"check": "max_increase", "metric": metric, "baseline": base_value, "candidate": value,
                       "increase": growth, "limit": args.max_increase, "ok": ok if judged else None})
        if not ok and judged:
            breaches.append(f"{metric} grew {growth:+.1%} ({base_value:.4g} -> {value:.4g}), limit "
                            f"+{args.max_increase:.1%}")
        deltas = layer_deltas(baseline, candidate)
    if args.max_epoch_s is not None:
        epoch_s = float(candidate["epoch"]["time_s"])
        ok = epoch_s <= args.max_epoch_s
        checks.append({"check": "max_epoch_s", "candidate": epoch_s, "limit": args.max_epoch_s, "ok": ok})
        if not ok:
            breaches.append(f"epoch takes {epoch_s:.4g} s, limit {args.max_epoch_s:.4g} s")
    if args.max_usd is not None:
        cost = candidate["job"]["cost_usd"]
        if cost is None:
            print(f"layercast gate: no price for {args.hardware!r}: give --price-usd-per-hour", file=sys.stderr)
            return EXIT_ERROR
        ok = cost <= args.max_usd
        checks.append({"check": "max_usd", "candidate": cost, "limit": args.max_usd, "ok": ok})
        if not ok:
            breaches.append(f"job costs {cost:.4g} USD, limit {args.max_usd:.4g} USD")
    if not deltas:  # no baseline: the layers that cost most are what to look at
        deltas = layer_deltas({"layers": []}, candidate)
    top = deltas[: args.top]
    refused = (uncosted is not None or base_uncosted is not None) and not args.allow_unsupported
    if args.json:
        print(json.dumps({
            "ok": not breaches and not refused, "breaches": breaches, "checks": checks,
            "unsupported": candidate["unsupported"],
            "baseline_unsupported": baseline["unsupported"] if args.baseline is not None else [],
            "allow_unsupported": args.allow_unsupported,
            "warnings": warnings,
            "layers": [{"name": d.name, "op_type": d.op_type, "baseline_ms": d.baseline_ms,
                        "candidate_ms": d.candidate_ms, "delta_ms": d.delta_ms} for d in top],
        }, indent=2))
    else:
        for line in breaches:
            print(f"BREACH: {line}")
        for who, uncosted_text in (("", uncosted), ("baseline: ", base_uncosted)):
            if uncosted_text is not None:
                print(f"UNSUPPORTED: {who}{uncosted_text}" + (
                    " (allowed by --allow-unsupported)" if args.allow_unsupported
                    else "; pass --allow-unsupported to gate the costed layers only"))
        if not breaches and not refused:
            print(f"ok: {metric} = {value:.4g} within every limit")
        for warning in warnings:
            print(f"warning: {warning}")
        print(f"top {len(top)} layers by {'growth' if args.baseline else 'time'} (ms per iteration):")
        from app.cli import format_table

        print(format_table([(d.name, d.op_type, _fmt_s(d.baseline_ms), _fmt_s(d.candidate_ms),
                             f"{d.delta_ms:+.4g}") for d in top],
                           ("layer", "op_type", "baseline_ms", "candidate_ms", "delta_ms")))
    return EXIT_BREACH if breaches else EXIT_UNSUPPORTED if refused else EXIT_OK


def uncosted_line(pred: dict[str, Any]) -> str | None:
    """One line naming a prediction's layers that cannot be costed (``unsupported``: op type, count, the
    first layer names), or None when every layer has a time. Their time is in no total."""
    groups = pred.get("unsupported") or []
    if not groups:
        return None
    n = sum(int(g["count"]) for g in groups)
    ops = ", ".join(f"{g['op_type']} x{g['count']} ({', '.join(g['layers'][:3])}"
                    f"{', ...' if len(g['layers']) > 3 else ''})" for g in groups)
    return f"{n} layer(s) cannot be costed and are left out of every total: {ops}"


COMMANDS = {"predict": _predict, "compare": _compare, "gate": _gate}


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``predict``/``compare``/``gate`` command; returns the exit code (see module docstring)."""
    if args.epochs is not None and args.dataset_size is None:
        print("layercast: --epochs needs --dataset-size", file=sys.stderr)
        return EXIT_ERROR
    if args.nodes < 1 or args.device_count < 1 or args.device_count % args.nodes:
        # checked here, for both backends: a comparison's devices_per_node would round it to other nodes
        print(f"layercast: --device-count {args.device_count} must spread evenly over --nodes {args.nodes} "
              "(both at least 1)", file=sys.stderr)
        return EXIT_ERROR
    for path in (args.model, getattr(args, "baseline", None)):
        if path is not None and not path.is_file():
            print(f"layercast: no such file: {path}", file=sys.stderr)
            return EXIT_ERROR
    try:
        return COMMANDS[args.command](args, _backend(args))
    except PredictionFailed as exc:
        print(f"layercast {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except ServerUnreachable as exc:
        print(f"layercast {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
