"""Cost of the gradient all-reduce of data-parallel training (pure).

Ring all-reduce (Patarasuk & Yuan 2009; the algorithm NCCL runs for large messages): each of ``n`` ranks
sends and receives ``2(n-1)/n`` of the buffer in ``2(n-1)`` steps (reduce-scatter, then all-gather), so

    t = base_latency + 2(n-1) × step_latency + 2(n-1)/n × bytes / (η × link_bandwidth)

with ``link_bandwidth`` the per-direction bandwidth of one rank's link, ``step_latency`` the fixed cost
of one ring step (the catalog's ``interconnect_latency_s``) and ``base_latency`` the launch cost of one
collective. This is NCCL's own tuning model (``src/graph/tuning.cc``: ``baseLat + nsteps × hwLat +
bytes / busBw``, ``nsteps = 2(n-1)`` for a ring all-reduce); :data:`NCCL_BASE_LATENCY_S` is its
``baseLat[Ring][Simple]``. ``η`` (:data:`BANDWIDTH_EFFICIENCY`) is the share of the datasheet link
bandwidth NCCL achieves, the one fitted number: fitted on the Vidur Azure A100-PCIe 4-rank rows
(PCIe 4.0, messages >= 64 MiB) and tested on the DGX A100 NVLink rows (docs/allreduce_validation.md).

Several nodes (``nodes`` × ``devices_per_node`` = ``n``): the hierarchical all-reduce NCCL and Horovod run
across nodes (Sergeev & Del Balso 2018, "Horovod", hierarchical allreduce; NCCL's tree/ring over NICs):
reduce-scatter inside each node over the intra-node link, an all-reduce of each rank's ``1/g`` shard across
the ``N`` nodes (the ``g`` ranks of a node in parallel, sharing the node's network bandwidth), all-gather
inside the node:

    t = base_latency + 2(g-1) × intra_step + 2(g-1)/g × bytes / (η × intra_bandwidth)
                     + 2(N-1) × net_step   + 2(N-1)/N × bytes / (η × node_network_bandwidth)

with ``g = devices_per_node``, ``N = nodes`` and ``node_network_bandwidth`` the per-direction bandwidth of
all of one node's NICs together. ``N = 1`` is the ring above; ``g = 1`` a ring over the network.
:data:`DEFAULT_NETWORK` is the network assumed when a request gives none (stated in its warnings).

Overlap with backward (PyTorch DDP, Li et al. VLDB 2020): gradients are all-reduced in buckets
(``bucket_cap_mb = 25``) as soon as a bucket's gradients are ready, while backward goes on. Only the last
bucket's all-reduce, which starts when backward ends, is always exposed; the earlier buckets are exposed
only by what their total exceeds the backward time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

#: NCCL ``baseLat[Ring][Simple]`` (src/graph/tuning.cc, NCCL 2.x): 8.4 µs per collective.
NCCL_BASE_LATENCY_S = 8.4e-6

#: Achieved / datasheet link bandwidth of a large NCCL ring all-reduce: the median over Vidur's
#: a100_pairwise_nvlink 4-rank rows >= 64 MiB (0.751, scripts/validate_allreduce.py re-derives it).
BANDWIDTH_EFFICIENCY = 0.75

#: PyTorch DDP's default ``bucket_cap_mb`` (25 MiB).
DDP_BUCKET_BYTES = 25 * 2**20

#: Most devices one node holds: the 8 GPUs of an NVIDIA DGX/HGX node (DGX A100, DGX H100, HGX A100/H100 8-GPU
#: baseboards), the NVLink/NVSwitch domain inside which the catalog's ``interconnect_*`` link joins every pair
#: of devices at its full bandwidth. More devices are several nodes joined by the network (``nodes``). Larger
#: NVLink domains (DGX-2's 16 V100 on NVSwitch, GB200 NVL72's 72 GPUs) cannot be expressed yet: such a system
#: is costed as nodes of 8 over the network.
MAX_DEVICES_PER_NODE = 8


def nodes_needed(device_count: int) -> int:
    """Fewest nodes that hold ``device_count`` devices in equal shares of at most :data:`MAX_DEVICES_PER_NODE`
    each: the smallest ``n >= ceil(device_count / MAX_DEVICES_PER_NODE)`` that divides ``device_count`` (a
    data-parallel request must spread its devices evenly over its nodes: 20 devices need 4 nodes of 5, not 3;
    a prime count above 8 needs one node per device). Raises ``ValueError`` for ``device_count < 1``."""
    if device_count < 1:
        raise ValueError(f"need at least one device, got {device_count}")
    n = math.ceil(device_count / MAX_DEVICES_PER_NODE)
    while device_count % n:
        n += 1
    return n


LinkKind = Literal["nvlink", "xgmi", "pcie", "network"]
LINK_KINDS: tuple[str, ...] = ("nvlink", "xgmi", "pcie", "network")


@dataclass(frozen=True, slots=True)
class Link:
    """What joins the devices of a data-parallel group: its kind, its per-direction bandwidth per device
    (bytes/s) and the fixed latency of one ring step (s)."""

    kind: LinkKind
    bandwidth_bytes_per_s: float
    step_latency_s: float


#: The network between nodes when a request spreads devices over nodes without naming one: one InfiniBand
#: HDR 200 Gb/s NIC per node = 25 GB/s per direction (NVIDIA ConnectX-6 datasheet); 6.6 µs per ring step
#: (the NCCL network step latency scripts/validate_allreduce.py uses). A DGX-class node with one NIC per GPU
#: has 8 × that: give ``inter_node_bandwidth_bytes_per_s`` then.
DEFAULT_NETWORK_BANDWIDTH_BYTES_PER_S = 25e9
DEFAULT_NETWORK_LATENCY_S = 6.6e-6


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` ranks joined by ``link`` (module docstring).

    ``n = 1`` costs nothing. Raises ``ValueError`` for ``n < 1`` or negative ``nbytes``.
    """
    if n < 1:
        raise ValueError(f"an all-reduce needs at least one rank, got {n}")
    if nbytes < 0:
        raise ValueError(f"negative all-reduce size {nbytes}")
    if n == 1 or nbytes == 0:
        return 0.0
    return (NCCL_BASE_LATENCY_S + 2 * (n - 1) * link.step_latency_s
            + 2 * (n - 1) / n * nbytes / (BANDWIDTH_EFFICIENCY * link.bandwidth_bytes_per_s))


@dataclass(frozen=True, slots=True)
class Topology:
    """Where the ``nodes × devices_per_node`` ranks sit: ``intra`` joins the devices of one node (``None``
    allowed only with one device per node), ``network`` the nodes (``None`` allowed only with one node)."""

    nodes: int
    devices_per_node: int
    intra: Link | None
    network: Link | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"need at least one node and one device per node, got {self.nodes} x "
                             f"{self.devices_per_node}")
        if self.devices_per_node > 1 and self.intra is None:
            raise ValueError(f"{self.devices_per_node} devices in a node need an intra-node link")
        if self.nodes > 1 and self.network is None:
            raise ValueError(f"{self.nodes} nodes need a network between them")

    @property
    def ranks(self) -> int:
        return self.nodes * self.devices_per_node


def allreduce_s(nbytes: float, topology: Topology) -> float:
    """Seconds of an all-reduce of ``nbytes`` over ``topology``: the ring of :func:`ring_allreduce_s`
    inside one node, the hierarchical all-reduce of the module docstring over several. One rank costs
    nothing. Raises ``ValueError`` for negative ``nbytes``."""
    if nbytes < 0:
        raise ValueError(f"negative all-reduce size {nbytes}")
    g, nodes = topology.devices_per_node, topology.nodes
    if nodes == 1:
        return ring_allreduce_s(nbytes, g, topology.intra) if g > 1 and topology.intra is not None else 0.0
    assert topology.network is not None  # __post_init__
    if nbytes == 0:
        return 0.0
    t = NCCL_BASE_LATENCY_S + 2 * (nodes - 1) * topology.network.step_latency_s + 2 * (nodes - 1) / nodes * (
        nbytes / (BANDWIDTH_EFFICIENCY * topology.network.bandwidth_bytes_per_s))
    if g > 1 and topology.intra is not None:
        t += 2 * (g - 1) * topology.intra.step_latency_s + 2 * (g - 1) / g * nbytes / (
            BANDWIDTH_EFFICIENCY * topology.intra.bandwidth_bytes_per_s)
    return t


@dataclass(frozen=True, slots=True)
class AllReduceCost:
    """Gradient all-reduce of one step: ``total_ms`` of all buckets back to back, ``exposed_ms`` what
    backward does not hide, ``buckets`` their number."""

    total_ms: float
    exposed_ms: float
    buckets: int


def bucketed_allreduce(
    gradient_bytes: float, topology: Topology, *, backward_ms: float, bucket_bytes: float = DDP_BUCKET_BYTES
) -> AllReduceCost:
    """All-reduce of ``gradient_bytes`` over ``topology`` in buckets of ``bucket_bytes`` overlapped with
    ``backward_ms``.

    exposed = t(last bucket) + max(0, Σ t(earlier buckets) − backward_ms) (module docstring), t from
    :func:`allreduce_s`. Raises ``ValueError`` for a non-positive bucket size or as :func:`allreduce_s`.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    if topology.ranks == 1 or gradient_bytes <= 0:
        allreduce_s(gradient_bytes, topology)  # validates
        return AllReduceCost(total_ms=0.0, exposed_ms=0.0, buckets=0)
    buckets = math.ceil(gradient_bytes / bucket_bytes)
    last_bytes = gradient_bytes - (buckets - 1) * bucket_bytes
    earlier_ms = (buckets - 1) * allreduce_s(bucket_bytes, topology) * 1e3
    last_ms = allreduce_s(last_bytes, topology) * 1e3
    exposed = last_ms + max(0.0, earlier_ms - max(backward_ms, 0.0))
    return AllReduceCost(total_ms=earlier_ms + last_ms, exposed_ms=exposed, buckets=buckets)
