"""The one aggregation: iteration, epoch and job arithmetic, data parallel, energy and money."""

from __future__ import annotations

import math

import pytest

from app.core.aggregate import (
    Aggregate,
    AggregationInput,
    Checkpointing,
    DataParallel,
    InputPipeline,
    InvalidAggregation,
    JobEstimate,
    LayerTime,
    aggregate,
)
from app.core.collectives import (
    BANDWIDTH_EFFICIENCY,
    DDP_BUCKET_BYTES,
    NCCL_BASE_LATENCY_S,
    Link,
    Topology,
    allreduce_s,
    bucketed_allreduce,
    ring_allreduce_s,
)

NVLINK = Link(kind="nvlink", bandwidth_bytes_per_s=300e9, step_latency_s=5e-6)
IB = Link(kind="network", bandwidth_bytes_per_s=25e9, step_latency_s=6.6e-6)
ONE_NODE = Topology(nodes=1, devices_per_node=8, intra=NVLINK)
LAYERS = [LayerTime(forward_ms=1.0, backward_ms=2.0, update_ms=0.5, total_ms_p10=3.0, total_ms_p90=4.5,
                    power_w=300.0)] * 10


def test_iteration_is_the_sum_of_layers_plus_overhead() -> None:
    it = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32, overhead_ms=2.0)).iteration
    assert it.forward_ms == pytest.approx(10.0)
    assert it.backward_ms == pytest.approx(20.0)
    assert it.time_ms == pytest.approx(35.0 + 2.0)
    assert it.time_ms_p10 == pytest.approx(32.0)
    assert it.time_ms_p90 == pytest.approx(47.0)
    assert it.samples_per_s == pytest.approx(32 / 0.037)
    assert it.scaling_efficiency == 1.0


def test_input_pipeline_hidden_when_overlapped_and_faster_than_compute() -> None:
    fast = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32,
                                      input_pipeline=InputPipeline(samples_per_s=32 / 0.010))).iteration
    assert fast.input_ms == pytest.approx(10.0)
    assert fast.time_ms == pytest.approx(35.0)
    assert fast.input_exposed_ms == pytest.approx(0.0)
    slow = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32,
                                      input_pipeline=InputPipeline(samples_per_s=32 / 0.050))).iteration
    assert slow.time_ms == pytest.approx(50.0)  # the loader bounds the step
    assert slow.input_exposed_ms == pytest.approx(15.0)
    serial = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32,
                                        input_pipeline=InputPipeline(samples_per_s=32 / 0.010, overlapped=False)))
    assert serial.iteration.time_ms == pytest.approx(45.0)


def test_epoch_counts_partial_batches_and_eval_passes_forward_only() -> None:
    agg = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32, dataset_size=1000, eval_size=100))
    assert agg.epoch is not None
    assert agg.epoch.iterations == 32  # ceil(1000 / 32)
    assert agg.epoch.eval_iterations == 4  # ceil(100 / 32)
    assert agg.epoch.eval_s == pytest.approx(4 * 10.0 / 1e3)  # forward only
    assert agg.epoch.time_s == pytest.approx(32 * 35.0 / 1e3 + 0.04)
    assert agg.job is None


def test_job_adds_checkpoint_writes_every_k_epochs() -> None:
    ck = Checkpointing(checkpoint_bytes=2e9, write_bandwidth_bytes_per_s=1e9, every_epochs=2)
    agg = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32, dataset_size=320, epochs=5,
                                     checkpointing=ck))
    assert agg.job is not None and agg.epoch is not None
    assert agg.job.checkpoints == 2  # after epochs 2 and 4
    assert agg.job.checkpoint_s == pytest.approx(4.0)
    assert agg.job.time_s == pytest.approx(5 * agg.epoch.time_s + 4.0)
    assert agg.job.time_h == pytest.approx(agg.job.time_s / 3600)


def test_a_job_runs_whole_iterations() -> None:
    """``epochs: 1e-9`` gave 1e-9 of an epoch (1.5e-6 s for a ResNet-50 job), far below the one iteration it
    runs. A job runs whole iterations: ⌈dataset / batch⌉ per whole epoch (as the epoch counts them, the last
    partial batch is one iteration) and ⌈fraction × dataset / batch⌉ for a fraction of an epoch, at least one."""

    def job(epochs: float, dataset: int = 1000, batch: int = 32) -> tuple[JobEstimate, Aggregate]:
        agg = aggregate(AggregationInput(layers=LAYERS, global_batch_size=batch, dataset_size=dataset, epochs=epochs,
                                         idle_power_w=50.0))
        assert agg.job is not None
        return agg.job, agg

    tiny, agg = job(1e-9)
    it = agg.iteration
    assert tiny.iterations == 1
    assert tiny.time_s == pytest.approx(it.time_ms / 1e3) and tiny.time_s_p90 == pytest.approx(it.time_ms_p90 / 1e3)
    assert it.energy_j is not None and tiny.energy_j == pytest.approx(it.energy_j)
    half, _ = job(0.5)
    assert half.iterations == 16  # 500 samples: 15 full batches and a partial one
    two, agg = job(2)
    assert agg.epoch is not None and two.iterations == 2 * agg.epoch.iterations == 64  # ordinary values unchanged
    assert two.time_s == pytest.approx(2 * agg.epoch.time_s)
    assert job(2.5)[0].iterations == 64 + 16
    # 1.01 epochs of 100 samples in batches of 1 are 101 iterations, although 0.01 x 100 comes out 1.0000000000000009
    assert job(1.01, dataset=100, batch=1)[0].iterations == 101
    assert job(0.01, dataset=10**15, batch=1)[0].iterations == 10**13


def test_ring_allreduce_formula() -> None:
    nbytes, n = 1e9, 8
    expected = NCCL_BASE_LATENCY_S + 2 * 7 / 8 * nbytes / (BANDWIDTH_EFFICIENCY * 300e9) + 2 * 7 * 5e-6
    assert ring_allreduce_s(nbytes, n, NVLINK) == pytest.approx(expected)
    assert ring_allreduce_s(nbytes, 1, NVLINK) == 0.0
    with pytest.raises(ValueError):
        ring_allreduce_s(nbytes, 0, NVLINK)


def test_buckets_hide_all_but_the_last_behind_backward() -> None:
    grad = 4 * DDP_BUCKET_BYTES
    long_backward = bucketed_allreduce(grad, ONE_NODE, backward_ms=1e3)
    last = ring_allreduce_s(DDP_BUCKET_BYTES, 8, NVLINK) * 1e3
    assert long_backward.buckets == 4
    assert long_backward.exposed_ms == pytest.approx(last)
    assert long_backward.total_ms == pytest.approx(4 * last)
    no_backward = bucketed_allreduce(grad, ONE_NODE, backward_ms=0.0)
    assert no_backward.exposed_ms == pytest.approx(no_backward.total_ms)


def test_hierarchical_allreduce_over_nodes() -> None:
    nbytes = 1e9
    # one node: the ring; one device per node: a ring over the network
    assert allreduce_s(nbytes, ONE_NODE) == ring_allreduce_s(nbytes, 8, NVLINK)
    assert allreduce_s(nbytes, Topology(nodes=4, devices_per_node=1, intra=None, network=IB)) == pytest.approx(
        ring_allreduce_s(nbytes, 4, IB))
    # 2 nodes x 8: in-node reduce-scatter + all-gather over NVLink, 2-node all-reduce over the network
    two = allreduce_s(nbytes, Topology(nodes=2, devices_per_node=8, intra=NVLINK, network=IB))
    expected = (NCCL_BASE_LATENCY_S + 2 * 7 * 5e-6 + 2 * 7 / 8 * nbytes / (BANDWIDTH_EFFICIENCY * 300e9)
                + 2 * 1 * 6.6e-6 + 2 * 1 / 2 * nbytes / (BANDWIDTH_EFFICIENCY * 25e9))
    assert two == pytest.approx(expected)
    # the network dominates: far slower than 16 devices on one NVLink ring, faster than a flat ring over IB
    assert ring_allreduce_s(nbytes, 16, NVLINK) < two < ring_allreduce_s(nbytes, 16, IB)
    with pytest.raises(ValueError, match="network"):
        Topology(nodes=2, devices_per_node=8, intra=NVLINK)
    with pytest.raises(ValueError, match="intra-node"):
        Topology(nodes=2, devices_per_node=8, intra=None, network=IB)


def test_data_parallel_over_nodes_in_the_aggregation() -> None:
    one_node = aggregate(AggregationInput(layers=LAYERS, global_batch_size=64, data_parallel=DataParallel(
        device_count=16, gradient_bytes=4 * DDP_BUCKET_BYTES, link=NVLINK)))
    two_nodes = aggregate(AggregationInput(layers=LAYERS, global_batch_size=64, data_parallel=DataParallel(
        device_count=16, gradient_bytes=4 * DDP_BUCKET_BYTES, link=NVLINK, nodes=2, network=IB)))
    topology = Topology(nodes=2, devices_per_node=8, intra=NVLINK, network=IB)
    expected = bucketed_allreduce(4 * DDP_BUCKET_BYTES, topology, backward_ms=20.0)
    assert two_nodes.iteration.allreduce_ms == pytest.approx(expected.total_ms)
    assert two_nodes.iteration.allreduce_ms > one_node.iteration.allreduce_ms
    assert two_nodes.iteration.scaling_efficiency < one_node.iteration.scaling_efficiency
    for bad, match in ((DataParallel(device_count=16, gradient_bytes=1e6, link=NVLINK, nodes=3, network=IB), "evenly"),
                       (DataParallel(device_count=16, gradient_bytes=1e6, link=NVLINK, nodes=2), "network")):
        with pytest.raises(InvalidAggregation, match=match):
            aggregate(AggregationInput(layers=LAYERS, global_batch_size=64, data_parallel=bad))
    # one device per node needs no intra-node link
    spread = aggregate(AggregationInput(layers=LAYERS, global_batch_size=64, data_parallel=DataParallel(
        device_count=4, gradient_bytes=1e6, link=None, nodes=4, network=IB)))
    assert spread.iteration.allreduce_ms > 0


def test_data_parallel_splits_the_batch_and_reports_scaling_efficiency() -> None:
    slow_link = Link(kind="pcie", bandwidth_bytes_per_s=1e9, step_latency_s=1e-5)
    dp = DataParallel(device_count=4, gradient_bytes=400e6, link=slow_link)
    it = aggregate(AggregationInput(layers=LAYERS, global_batch_size=64, data_parallel=dp)).iteration
    assert it.per_device_batch_size == 16
    assert it.allreduce_buckets == math.ceil(400e6 / DDP_BUCKET_BYTES)
    assert it.allreduce_exposed_ms > 0
    assert it.time_ms == pytest.approx(35.0 + it.allreduce_exposed_ms)
    assert it.scaling_efficiency == pytest.approx(35.0 / it.time_ms)
    assert it.samples_per_s == pytest.approx(64 / (it.time_ms / 1e3))
    with pytest.raises(InvalidAggregation, match="divide"):
        aggregate(AggregationInput(layers=LAYERS, global_batch_size=63, data_parallel=dp))
    with pytest.raises(InvalidAggregation, match="interconnect"):
        aggregate(AggregationInput(layers=LAYERS, global_batch_size=64,
                                   data_parallel=DataParallel(device_count=4, gradient_bytes=1.0, link=None)))


def test_energy_cost_and_co2_of_a_job() -> None:
    dp = DataParallel(device_count=2, gradient_bytes=1e6, link=NVLINK)
    agg = aggregate(AggregationInput(layers=LAYERS, global_batch_size=32, overhead_ms=5.0, data_parallel=dp,
                                     dataset_size=320, epochs=3, idle_power_w=50.0, price_usd_per_hour=4.0,
                                     grid_gco2_per_kwh=400.0))
    it, job = agg.iteration, agg.job
    assert job is not None
    # 300 W for the 35 ms of layers, 50 W for the rest of the step, on both devices
    assert it.energy_j == pytest.approx(2 * (300 * 0.035 + 50 * (it.time_ms - 35.0) / 1e3))
    assert job.energy_j == pytest.approx(3 * 10 * it.energy_j)
    assert job.energy_kwh == pytest.approx(job.energy_j / 3.6e6)
    assert job.device_hours == pytest.approx(2 * job.time_s / 3600)
    assert job.cost_usd == pytest.approx(job.device_hours * 4.0)
    assert job.co2_kg == pytest.approx(job.energy_kwh * 0.4)
    no_power = aggregate(AggregationInput(layers=[LayerTime(1, 1, 1, 2, 4)], global_batch_size=1, dataset_size=1,
                                          epochs=1, price_usd_per_hour=1.0))
    assert no_power.job is not None and no_power.job.energy_j is None and no_power.job.cost_usd is not None
