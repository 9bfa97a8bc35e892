"""NeuSight parser on the real files in ../shared/data/neusight (read in place)."""

from __future__ import annotations

import csv
import gzip
from collections import Counter
from pathlib import Path

import pytest

from app.core.json_import import import_json
from app.core.vocab import Granularity, SoftwareStack
from app.hardware.catalog import load_catalog
from app.measurements.importers import ImportFormatError
from app.measurements.neusight import (
    NEUSIGHT_HARDWARE_IDS,
    iter_neusight,
    neusight_family,
    neusight_files,
)
from tests.helpers import SHARED_DATA

NEUSIGHT = SHARED_DATA / "neusight"


def _csv_rows(path: Path, n: int) -> list[dict[str, str]]:
    with gzip.open(path, "rt", newline="") as fh:
        reader = csv.DictReader(fh)
        return [row for _, row in zip(range(n), reader, strict=False)]


def _rowcounts() -> Counter[tuple[str, str]]:
    """(gpu, family) -> rows, from the data set's own ``rowcounts.csv`` (elementwise ops summed)."""
    counts: Counter[tuple[str, str]] = Counter()
    elementwise = {"add", "addu", "div", "divu", "gelu", "mul", "mulu", "pow", "powu", "relu", "tanh"}
    with (NEUSIGHT / "rowcounts.csv").open(newline="") as fh:
        for row in csv.DictReader(fh):
            counts[(row["gpu"], "elementwise" if row["op"] in elementwise else row["op"])] += int(row["rows"])
    return counts


def test_every_device_maps_to_a_catalog_entry() -> None:
    assert set(NEUSIGHT_HARDWARE_IDS.values()) <= set(load_catalog())


def test_thirty_files_and_the_documented_row_total() -> None:
    files = neusight_files(NEUSIGHT)
    assert len(files) == 30
    assert sum(_rowcounts().values()) == 249_797
    assert len(neusight_files(NEUSIGHT, families=("ln", "softmax"))) == 12
    with pytest.raises(ValueError, match="unknown NeuSight families"):
        neusight_files(NEUSIGHT, families=("attention",))


@pytest.mark.parametrize(
    ("name", "op_kind"),
    [
        ("train_conv_T4.csv.gz", "conv"),
        ("train_ln_MI100.csv.gz", "norm"),
        ("train_softmax_A100-PCIe-40GB.csv.gz", "softmax"),
        ("train_linear_P4.csv.gz", "gemm"),
    ],
)
def test_whole_file_counts_match_rowcounts(name: str, op_kind: str) -> None:
    stream = iter_neusight(NEUSIGHT / name)
    records = list(stream)
    gpu = name.removesuffix(".csv.gz").split("_", 2)[2]
    family = neusight_family(name)
    assert stream.rows_read == stream.records == len(records) == _rowcounts()[(gpu, family)]
    assert not stream.skipped  # the train split has no missing or non-positive latency
    assert {r.op_kind for r in records} == {op_kind}
    assert [r.context["source_row"] for r in records] == list(range(len(records)))


def test_elementwise_file_has_eleven_ops_of_1750_rows() -> None:
    records = list(iter_neusight(NEUSIGHT / "train_elementwise_MI210.csv.gz"))
    per_op = Counter(r.context["op_name"] for r in records)
    assert len(per_op) == 11 and set(per_op.values()) == {1750}
    kinds = Counter(r.op_kind for r in records)
    assert kinds == {"elementwise": 8 * 1750, "activation": 3 * 1750}
    scalar = {r.config["layer"]["fn"] for r in records
              if r.op_kind == "elementwise" and r.config["layer"]["operand"] == "scalar"}
    assert scalar == {"add", "mul", "pow", "div"}


def test_bmm_rows_field_by_field() -> None:
    path = NEUSIGHT / "train_bmm_T4.csv.gz"
    raw = _csv_rows(path, 5)
    records = list(iter_neusight(path, limit=5))
    assert len(records) == 5
    for row, rec in zip(raw, records, strict=True):
        b, m, n, k = (int(row[c]) for c in "BMNK")
        assert rec.hardware_id == "t4" and rec.source == "neusight" and rec.op_kind == "matmul"
        assert rec.pass_ == "forward" and rec.optimizer == "none" and rec.precision == "fp32-strict"
        assert rec.software_stack is SoftwareStack.PYTORCH_EAGER and rec.granularity is Granularity.KERNEL
        assert rec.batch_size == b
        assert rec.config == {"layer": {"op": "matmul", "a": [b, m, n], "b": [b, n, k]}}
        assert rec.time_ms_median == float(row["Latency"]) and rec.repetitions == 25
        ctx = rec.context
        assert ctx["kernel_name"] == row["Kernel Name"]
        assert ctx["grid"] == [int(row["Grid x"]), int(row["Grid y"]), int(row["Grid z"])]
        assert ctx["block"] == [int(row["Block x"]), int(row["Block y"]), int(row["Block z"])]
        assert ctx["warps_per_sm"] == float(row["Warps per SM"])
        assert (ctx["framework"], ctx["framework_version"], ctx["cudnn_version"]) == ("PyTorch", "2.1.0+cu121", "8902")
        assert ctx["device_name"] == "Tesla T4" and ctx["upstream_file"] == row["source_file"]
    # the first row, by hand: bmm 13 x (27x15 @ 15x29) on volta_sgemm_64x64_nn, grid 1x1x13
    assert records[0].config["layer"]["a"] == [13, 27, 15] and records[0].context["grid"] == [1, 1, 13]
    assert records[0].time_ms_median == pytest.approx(0.035466667264699936)


def test_conv_rows_build_the_measured_layer() -> None:
    path = NEUSIGHT / "train_conv_A100-PCIe-80GB.csv.gz"
    raw = _csv_rows(path, 3)
    for row, rec in zip(raw, iter_neusight(path, limit=3), strict=True):
        assert rec.hardware_id == "a100-pcie-80gb"
        graph = import_json({"input_shape": rec.config["input_shape"], "layers": [rec.config["layer"]]},
                            batch_size=rec.batch_size)
        (layer,) = graph.layers
        size = int(row["Input_Size"])
        assert layer.inputs[0].shape == (int(row["B"]), int(row["Input_Channel"]), size, size)
        assert layer.outputs[0].shape == (int(row["B"]), int(row["Output_Channel"]), size, size)  # 3x3, s1, p1
        assert not layer.weights[1:]  # bias=False, as NeuSight's nn.Conv2d
        listed = [k for k in row["Kernels"].split(";") if k]
        assert rec.context.get("kernels", [row["Kernel Name"].lower()]) == listed  # kept when it says more
        assert rec.context["kernel_name"] == row["Kernel Name"]
    assert len(next(iter(iter_neusight(path, limit=2))).context.get("kernels", [])) == 0
    assert len(list(iter_neusight(path, limit=2))[1].context["kernels"]) == 4  # winograd: 3 transforms + sgemm


def test_amd_rows_take_the_torch_version_from_the_upstream_folder() -> None:
    (rec,) = list(iter_neusight(NEUSIGHT / "train_softmax_MI100.csv.gz", limit=1))
    assert rec.hardware_id == "mi100" and rec.context["framework_version"] == "2.4.1"
    assert "cudnn_version" not in rec.context and "warps_per_sm" not in rec.context
    assert rec.config == {"input_shape": [13], "layer": {"op": "softmax"}} and rec.batch_size == 58


def _write(tmp_path: Path, name: str, rows: list[dict[str, str]]) -> Path:
    path = tmp_path / name
    with gzip.open(path, "wt", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_skips_are_counted_with_their_reasons(tmp_path: Path) -> None:
    rows = _csv_rows(NEUSIGHT / "train_ln_T4.csv.gz", 4)
    rows[1]["Latency"] = ""
    rows[2]["Latency"] = "-1"
    rows[3]["Device"] = "Tesla V100-PCIE-32GB"
    stream = iter_neusight(_write(tmp_path, "train_ln_T4.csv.gz", rows))
    assert len(list(stream)) == 1
    assert stream.rows_read == 4
    assert stream.skipped == {("Tesla T4", "missing_time"): 1, ("Tesla T4", "non_positive_time"): 1,
                              ("Tesla V100-PCIE-32GB", "unknown_device"): 1}


def test_malformed_files_raise(tmp_path: Path) -> None:
    rows = _csv_rows(NEUSIGHT / "train_ln_T4.csv.gz", 2)
    rows[1]["OPName"] = "softmax"
    with pytest.raises(ImportFormatError, match="line 3: OPName 'softmax' is not in family 'ln'"):
        list(iter_neusight(_write(tmp_path, "train_ln_T4.csv.gz", rows)))
    rows[1]["OPName"], rows[1]["H"] = "ln", "0"
    with pytest.raises(ImportFormatError, match="column 'H'"):
        list(iter_neusight(_write(tmp_path, "train_ln_T4.csv.gz", rows)))
    with pytest.raises(ImportFormatError, match="train_<family>_<gpu>"):
        iter_neusight(_write(tmp_path, "ln_T4.csv.gz", rows))
    with pytest.raises(FileNotFoundError):
        iter_neusight(tmp_path / "train_ln_X.csv.gz")
