"""The campaign runner: rows appended and flushed, resume skips what is measured, interruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core.json_import import import_json
from app.measurements.profiler_rows import iter_profiler_layers
from app.profiler import iter_rows

torch = pytest.importorskip("torch")
from app.profiler import run  # noqa: E402  (needs torch at call time only, imported after the skip)


def _args(out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--n-configs", "4", "--families", "activation,linear", "--max-train-ms", "0.5",
            "--warmup", "1", "--reps", "3", "--max-seconds", "0.3", "--precision", "fp32,bf16",
            "--bf16-fraction", "1.0", "--threads", str(torch.get_num_threads()), *extra]


def test_campaign_writes_rows_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shard.jsonl"
    assert run.main(_args(out)) == 0
    rows = list(iter_rows(out))
    assert len(rows) == 8 and {r["precision"] for r in rows} == {"fp32", "bf16"}
    assert len({r["config_id"] for r in rows}) == 4
    for r in rows:
        assert r["status"] == "ok" and r["forward_ms"] > 0 and r["train_step_ms"] > 0
        assert r["context"]["device"] == "cpu" and r["context"]["threads"] == torch.get_num_threads()
        assert r["measured_at"] and r["schema"] == 1
        g = import_json(r["graph"], batch_size=r["batch_size"])
        assert g.layers[0].kind.value == r["op_kind"]
    recs = list(iter_profiler_layers(out, hardware_id="local"))
    assert {x.pass_ for x in recs} >= {"forward", "train_step", "backward"}
    assert {x.context["source_row"] for x in recs} == set(range(8))
    err = capsys.readouterr().err
    assert "done: 8 ok" in err

    # resume: nothing left; a torn last line (killed writer) is ignored and re-measured
    first = rows[0]["config_id"], rows[0]["precision"]
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[1:]) + "\n" + lines[0][:40])
    assert run.main(_args(out)) == 0
    again = list(iter_rows(out))
    assert len(again) == 8 and (again[-1]["config_id"], again[-1]["precision"]) == first
    assert "0 to go" not in capsys.readouterr().err  # one row had to be measured again
    assert run.main(_args(out)) == 0
    assert "0 to go" in capsys.readouterr().err


def test_interrupt_keeps_rows_and_returns_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.profiler import timing

    out = tmp_path / "shard.jsonl"
    real = timing.measure_config
    calls = {"n": 0}

    def flaky(*a, **k):  # noqa: ANN002, ANN003
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(timing, "measure_config", flaky)
    assert run.main(_args(out)) == 130
    assert len(list(iter_rows(out))) == 2
    monkeypatch.setattr(timing, "measure_config", real)
    assert run.main(_args(out)) == 0
    assert len(list(iter_rows(out))) == 8


def test_errors_are_recorded_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.profiler import timing

    def broken(*a, **k):  # noqa: ANN002, ANN003
        raise RuntimeError("kernel missing")

    monkeypatch.setattr(timing, "measure_config", broken)
    out = tmp_path / "shard.jsonl"
    assert run.main(_args(out, "--precision", "fp32")) == 0
    rows = list(iter_rows(out))
    assert len(rows) == 4 and all(r["status"] == "error" and "kernel missing" in r["error"] for r in rows)
    errors = iter_profiler_layers(out, hardware_id="local")
    assert list(errors) == [] and dict(errors.skipped) == {("cpu", "profiler_error"): 4}


def test_refine_from_adds_neighbours(tmp_path: Path) -> None:
    out = tmp_path / "shard.jsonl"
    assert run.main(_args(out, "--precision", "fp32")) == 0
    errs = tmp_path / "errors.jsonl"
    with errs.open("w") as fh:
        for i, r in enumerate(iter_rows(out)):
            fh.write(json.dumps({**r, "error": float(i)}) + "\n")
    assert run.main(_args(out, "--precision", "fp32", "--refine-from", str(errs), "--n-refine", "2")) == 0
    rows = list(iter_rows(out))
    refined = [r for r in rows if r["origin"].startswith("refine:")]
    assert 1 <= len(refined) <= 2


def test_gz_output_rejected(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        run.main(["--out", str(tmp_path / "x.jsonl.gz")])
