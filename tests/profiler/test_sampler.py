"""Configuration sampling: determinism, coverage of the families, IR round trip, refinement hook."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from app.core.costs import layer_cost, mac_count
from app.core.ir import OpKind
from app.core.json_import import import_json
from app.profiler.sampler import (
    FAMILY_KIND,
    FAMILY_WEIGHTS,
    LayerConfig,
    estimate_train_ms,
    family_counts,
    family_for_spec,
    perturb,
    propose_neighbours,
    sample_configs,
)


@pytest.fixture(scope="module")
def draw() -> list[LayerConfig]:
    return sample_configs(600, seed=7)


def test_deterministic_and_prefix_stable(draw: list[LayerConfig]) -> None:
    again = sample_configs(600, seed=7)
    assert [c.config_id for c in again] == [c.config_id for c in draw]
    assert [c.config_id for c in sample_configs(50, seed=7)] == [c.config_id for c in draw[:50]]
    other = sample_configs(50, seed=8)
    assert [c.config_id for c in other] != [c.config_id for c in draw[:50]]


def test_distinct_and_every_family_present(draw: list[LayerConfig]) -> None:
    assert len({c.config_id for c in draw}) == len(draw) == 600
    counts = family_counts(draw)
    assert set(counts) == set(FAMILY_WEIGHTS)
    assert counts["conv2d"] > counts["instancenorm"]  # weights are respected
    origins = {c.origin for c in draw}
    assert {"resnet50", "mobilenet_v2", "uniform"} <= origins
    assert any(o.startswith("bert") for o in origins) and any(o.startswith("gpt2") for o in origins)


def test_every_config_builds_ir_of_its_kind_within_budget(draw: list[LayerConfig]) -> None:
    for c in draw:
        layers = c.to_layers()
        assert layers[0].kind is FAMILY_KIND[c.family]
        assert all(layer_cost(la).supported for la in layers)
        assert estimate_train_ms(c) <= 30.0
        assert (c.optimizer == "none") == (c.params() == 0)


def test_json_families_rebuild_with_import_json(draw: list[LayerConfig]) -> None:
    for c in draw:
        doc = c.graph_doc()
        if c.family in ("matmul", "attention"):
            assert doc is None and c.shapes
            continue
        assert doc is not None
        g = import_json(doc, batch_size=c.batch_size)
        assert len(g.layers) == 1 and g.layers[0].inputs[0].shape == (c.batch_size, *c.input_shape)


def test_config_id_is_pinned_and_ignores_origin_and_optimizer() -> None:
    c = LayerConfig("linear", "linear", 4, (16,), {"op": "linear", "out_features": 8, "bias": True})
    assert c.config_id == "linear-c1c69d66ff3b8fca"  # changing it orphans every committed row
    assert replace(c, origin="x", optimizer="adam").config_id == c.config_id
    assert replace(c, batch_size=8).config_id != c.config_id
    assert replace(c, needs_input_grad=False).config_id != c.config_id


def test_row_round_trip() -> None:
    for c in sample_configs(80, seed=3):
        back = LayerConfig.from_row(c.row_fields())
        assert back.config_id == c.config_id and back.optimizer == c.optimizer


def test_input_grad_flag_and_precision() -> None:
    c = LayerConfig("conv2d", "conv2d", 2, (3, 8, 8), {"op": "conv2d", "out_channels": 4, "kernel_size": 3})
    assert c.to_layers()[0].needs_input_grad is True  # an inner layer, unlike import_json's default
    assert replace(c, needs_input_grad=False).to_layers()[0].needs_input_grad is False
    assert c.to_layers("bf16")[0].inputs[0].dtype == "bfloat16"
    e = LayerConfig("embedding", "embedding", 2, (5,), {"op": "embedding", "num_embeddings": 10,
                                                         "embedding_dim": 4}, needs_input_grad=False)
    assert (e.graph_doc("bf16") or {})["input_dtype"] == "int64"
    assert e.to_layers()[0].kind is OpKind.EMBEDDING


def test_matmul_and_attention_shape_records() -> None:
    m = LayerConfig("matmul", "matmul", 2, shapes={"a": [2, 3, 5, 7], "b": [2, 3, 7, 11]})
    (layer,) = m.to_layers()
    assert layer.kind is OpKind.MATMUL and mac_count(layer) == 2 * 3 * 5 * 7 * 11
    assert layer.outputs[0].shape == (2, 3, 5, 11)
    a = LayerConfig("attention", "attention", 2,
                    shapes={"heads": 4, "seq_q": 16, "seq_kv": 16, "head_dim": 8, "causal": True})
    qk, sm, pv = a.to_layers()
    assert (qk.kind, sm.kind, pv.kind) == (OpKind.MATMUL, OpKind.SOFTMAX, OpKind.MATMUL)
    assert mac_count(qk) == mac_count(pv) == 2 * 4 * 16 * 16 * 8
    with pytest.raises(ValueError):
        LayerConfig("matmul", "matmul", 1, shapes={"a": [1, 2, 3], "b": [1, 4, 5]}).to_layers()


def test_unknown_family_rejected() -> None:
    with pytest.raises(ValueError, match="unknown family"):
        sample_configs(3, families=["conv9d"])


def test_family_restriction() -> None:
    cs = sample_configs(40, seed=1, families=["lstm", "gru"])
    assert {c.family for c in cs} == {"lstm", "gru"}


def test_family_for_spec() -> None:
    assert family_for_spec({"op": "conv2d", "out_channels": 8, "groups": 8}, (8, 4, 4)) == "conv2d_depthwise"
    assert family_for_spec({"op": "conv2d", "out_channels": 8, "groups": 2}, (8, 4, 4)) == "conv2d_grouped"
    assert family_for_spec({"op": "conv2d", "out_channels": 8}, (8, 4, 4)) == "conv2d"
    assert family_for_spec({"op": "gelu"}, (8,)) == "activation"
    assert family_for_spec({"op": "global_avgpool"}, (8, 4, 4)) == "global_pool"
    with pytest.raises(ValueError):
        family_for_spec({"op": "flatten"}, (8, 4, 4))


def test_perturb_gives_valid_neighbours() -> None:
    import random

    rng = random.Random(0)
    for c in sample_configs(150, seed=11):
        n = perturb(c, rng)
        if n is None:
            continue
        assert n.origin == f"refine:{c.config_id}"
        try:
            n.to_layers()
        except Exception:  # a neighbour may be invalid (kernel larger than a shrunk input); never silently
            continue


def test_propose_neighbours_targets_the_worst() -> None:
    cs = sample_configs(100, seed=5)
    errors = [(c, 0.01) for c in cs]
    worst = {cs[3].config_id, cs[42].config_id}
    errors[3] = (cs[3], 2.0)
    errors[42] = (cs[42], -3.0)  # sign ignored: |error|
    out = propose_neighbours(errors, n=12, seed=0, top_fraction=0.02)
    assert 0 < len(out) <= 12
    assert len({c.config_id for c in out}) == len(out)
    assert {c.origin.split(":", 1)[1] for c in out} <= worst
    assert not ({c.config_id for c in out} & worst)  # neighbours, not the parents again
    for c in out:
        c.to_layers()
        assert estimate_train_ms(c) <= 30.0
    again = propose_neighbours(errors, n=12, seed=0, top_fraction=0.02)
    assert [c.config_id for c in again] == [c.config_id for c in out]
    assert propose_neighbours([], n=5) == []


def test_sampler_and_package_do_not_import_torch() -> None:
    code = "import sys, app.profiler, app.profiler.sampler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
