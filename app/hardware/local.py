"""Spec of the machine this process runs on (hardware id ``local``), detected at runtime.

Values come from ``/proc/cpuinfo``, ``/sys/devices/system/cpu`` and psutil; memory bandwidth is measured
once and stored with the ``local`` hardware row: later starts reuse it while the machine is the same
(:func:`local_cpu_spec`), so a prediction on ``local`` does not change with the noise of a re-measurement.
Every value records its origin in ``sources``. Any file or field that is missing (containers, VMs, non-Linux)
degrades to the next source or is left out; detection never raises.

Peak FLOP/s is the textbook bound ``cores × clock × (vector_bits / 32) × 2 (FMA) × FMA ports``:

- vector width from CPU flags: x86 ``avx512f`` → 512, ``avx2``/``avx`` → 256, else 128 (SSE2);
  aarch64 ``sve`` → the kernel's SVE default vector length when readable (else 128), ``asimd`` → 128.
- FMA ports (assumption): 2 for x86 cores with FMA3 and AVX2/AVX-512 (Intel Haswell and later server
  cores, AMD Zen 2+) and for aarch64; 1 without FMA (an AVX adder and multiplier pair issue the
  equivalent of one FMA). This overstates Intel parts with a single AVX-512 FMA unit (Xeon Bronze/Silver,
  some Gold) and AMD Zen 4, which runs AVX-512 on 256-bit units: both at half the stated rate.
- clock: the maximum (turbo) frequency, the same convention as the GPU boost-clock peaks of the catalog;
  sustained all-core vector clocks are lower.
- fp64 peak is half the fp32 peak (half as many lanes).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

import numpy as np
import psutil

from app.core.hardware import HardwareSpec

logger = logging.getLogger(__name__)

LOCAL_ID = "local"
_CPUINFO = Path("/proc/cpuinfo")
_SYS_CPU = Path("/sys/devices/system/cpu")
_SVE_VL = Path("/proc/sys/abi/sve_default_vector_length")

_CURRENT_CLOCK_SOURCE = "/proc/cpuinfo cpu MHz"

BANDWIDTH_BUDGET_S = 0.5
"""Wall-time budget of the memory bandwidth measurement (allocation and first touch included)."""


@dataclass(frozen=True)
class BandwidthMeasurement:
    """Result of :func:`measure_memory_bandwidth`: best rate in bytes/s and how it was obtained."""

    bytes_per_s: float
    array_bytes: int
    threads: int
    repetitions: int


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _parse_cpuinfo(text: str | None) -> dict[str, str]:
    """First value of each key of ``/proc/cpuinfo`` (keys lower-cased)."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def _parse_cache_size(text: str) -> int | None:
    """``"32K"`` / ``"1024K"`` / ``"32M"`` (sysfs cache size) → bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text)
    if not match:
        return None
    return int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]


def _cache_sizes() -> dict[int, int]:
    """Total bytes of each unified/data cache level over its distinct instances, from sysfs.

    E.g. ``{2: 16 × 1 MiB, 3: 32 MiB}``. Empty when ``/sys/devices/system/cpu/*/cache`` is absent.
    """
    seen: set[tuple[int, str]] = set()
    totals: dict[int, int] = {}
    try:
        index_dirs = sorted(_SYS_CPU.glob("cpu[0-9]*/cache/index[0-9]*"))
    except OSError:
        return {}
    for index in index_dirs:
        level_txt, type_txt = _read_text(index / "level"), _read_text(index / "type")
        size_txt, shared = _read_text(index / "size"), _read_text(index / "shared_cpu_list")
        if not (level_txt and type_txt and size_txt) or type_txt.strip() == "Instruction":
            continue
        try:
            level = int(level_txt)
        except ValueError:
            continue
        size = _parse_cache_size(size_txt)
        key = (level, (shared or str(index)).strip())
        if size is None or key in seen:
            continue
        seen.add(key)
        totals[level] = totals.get(level, 0) + size
    return totals


def _physical_cores() -> tuple[int, str]:
    """Physical cores usable by this process, and the source.

    psutil's physical core count, scaled down when the CPU affinity mask (containers, taskset) allows
    fewer logical CPUs than the machine has.
    """
    physical = psutil.cpu_count(logical=False)
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    source = "psutil.cpu_count(logical=False)"
    if not physical:
        physical, source = logical, "os.cpu_count() (physical count unavailable; logical CPUs)"
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = logical
    if allowed < logical:
        scaled = max(1, round(physical * allowed / logical))
        return scaled, f"{source} = {physical}, scaled by affinity mask {allowed}/{logical} logical CPUs"
    return int(physical), source


def _frequencies_mhz(cpuinfo: dict[str, str]) -> tuple[float | None, str, float | None, str]:
    """(max MHz, source, base MHz, source); ``None`` where unknown.

    Max: sysfs ``cpuinfo_max_freq``, else ``psutil.cpu_freq().max``, else the ``@ x.xxGHz`` of the model
    name, else the current ``cpu MHz`` of ``/proc/cpuinfo``. Base: sysfs ``base_frequency``
    (intel_pstate), else the model-name frequency.
    """
    cpufreq = _SYS_CPU / "cpu0" / "cpufreq"
    model_ghz = None
    match = re.search(r"@\s*([\d.]+)\s*GHz", cpuinfo.get("model name", ""))
    if match:
        model_ghz = float(match.group(1)) * 1000

    def sys_khz(name: str) -> float | None:
        text = _read_text(cpufreq / name)
        try:
            value = float(text) / 1000 if text else None
        except ValueError:
            return None
        return value if value and value > 0 else None

    max_mhz, max_src = sys_khz("cpuinfo_max_freq"), f"{cpufreq}/cpuinfo_max_freq"
    if max_mhz is None:
        try:
            freq = psutil.cpu_freq()
        except (OSError, NotImplementedError, RuntimeError):
            freq = None
        if freq is not None and freq.max and freq.max > 0:
            max_mhz, max_src = float(freq.max), "psutil.cpu_freq().max"
        elif model_ghz:
            max_mhz, max_src = model_ghz, "/proc/cpuinfo model name (nominal clock)"
        else:
            try:
                current = float(cpuinfo.get("cpu mhz", ""))
            except ValueError:
                current = 0.0
            if current > 0:
                max_mhz, max_src = current, f"{_CURRENT_CLOCK_SOURCE} (current clock; max unavailable)"
    base_mhz, base_src = sys_khz("base_frequency"), f"{cpufreq}/base_frequency"
    if base_mhz is None and model_ghz:
        base_mhz, base_src = model_ghz, "/proc/cpuinfo model name"
    if base_mhz is not None and max_mhz is not None and base_mhz > max_mhz:
        base_mhz = None
    return max_mhz, max_src, base_mhz, base_src


def _vector_width(machine: str, flags: set[str]) -> tuple[int, int, str]:
    """(vector bits, FMA ports, source) from the CPU flags; see the module docstring."""
    if machine in ("aarch64", "arm64"):
        if "sve" in flags:
            text = _read_text(_SVE_VL)
            try:
                bits = int(text) * 8 if text else 128
            except ValueError:
                bits = 128
            return bits, 2, f"/proc/cpuinfo Features: sve ({_SVE_VL if text else 'length unknown, 128'})"
        return 128, 2, "/proc/cpuinfo Features: asimd (128-bit NEON)"
    if "avx512f" in flags:
        bits, flag = 512, "avx512f"
    elif "avx2" in flags:
        bits, flag = 256, "avx2"
    elif "avx" in flags:
        bits, flag = 256, "avx"
    else:
        bits, flag = 128, "no avx (SSE2)" if flags else "flags unavailable (assumed SSE2)"
    ports = 2 if ("fma" in flags and bits >= 256 and flag != "avx") else 1
    return bits, ports, f"/proc/cpuinfo flags: {flag}"


def measure_memory_bandwidth(
    *, threads: int, llc_bytes: int | None = None, budget_s: float = BANDWIDTH_BUDGET_S
) -> BandwidthMeasurement:
    """Sustained memory bandwidth in bytes/s, STREAM "Add" kernel ``a = b + c`` on float64 with numpy.

    Each of ``threads`` threads runs ``numpy.add`` on its own slice (numpy releases the GIL in ufunc
    loops, so the slices run in parallel). Each array is at least 2× the last-level cache
    (``llc_bytes``, 32 MiB assumed when unknown) and at least 32 MiB, so a pass streams 6× the LLC and
    reuses nothing from cache (STREAM asks for 4× per array; halved to keep first-touch page faults
    inside the budget); the three arrays together are capped at 1/8 of available memory and 512 MiB.
    Bytes are counted as STREAM does: 24 per element (two reads, one write; write-allocate traffic not
    counted). Repeats until ``budget_s`` of wall time has passed (allocation and first touch included,
    at least 2 timed runs) and returns the best run.
    """
    threads = max(1, threads)
    llc = llc_bytes or 32 * 2**20
    total = 3 * max(2 * llc, 32 * 2**20)
    total = min(total, 512 * 2**20, max(psutil.virtual_memory().available // 8, 24 * 2**20))
    n = max(total // 24, threads * 1024)
    start = time.perf_counter()
    a = np.empty(n)
    b = np.empty(n)
    c = np.empty(n)
    bounds = np.linspace(0, n, threads + 1).astype(int)
    slices = [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

    def touch(s: slice) -> None:  # first touch from the worker threads (NUMA placement)
        a[s] = 0.0
        b[s] = 1.0
        c[s] = 2.0

    def add(s: slice) -> None:
        np.add(b[s], c[s], out=a[s])

    best = 0.0
    reps = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(touch, slices))
        list(pool.map(add, slices))  # warm-up
        while reps < 2 or (time.perf_counter() - start < budget_s and reps < 50):
            t0 = time.perf_counter()
            list(pool.map(add, slices))
            dt = time.perf_counter() - t0
            reps += 1
            if dt > 0:
                best = max(best, 24 * n / dt)
    return BandwidthMeasurement(bytes_per_s=best, array_bytes=8 * n, threads=threads, repetitions=reps)


def _measure_matmul_flops(threads: int) -> float:
    """Achieved float32 FLOP/s of a 1024³ numpy matmul (BLAS), best of 3; fallback peak estimate."""
    del threads  # BLAS picks its own thread count
    m = np.ones((1024, 1024), dtype=np.float32)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        m @ m
        dt = time.perf_counter() - t0
        if dt > 0:
            best = max(best, 2 * 1024**3 / dt)
    return best


def _vendor(cpuinfo: dict[str, str]) -> str:
    vendor_id = cpuinfo.get("vendor_id", "")
    known = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}
    if vendor_id:
        return known.get(vendor_id, vendor_id)
    implementer = cpuinfo.get("cpu implementer", "").lower()
    arm = {"0x41": "Arm", "0x61": "Apple", "0xc0": "Ampere", "0x48": "HiSilicon", "0x51": "Qualcomm"}
    return arm.get(implementer, "unknown")


_IDENTITY_FIELDS = (
    "name", "architecture", "compute_units", "memory_bytes", "vector_width_bits", "boost_clock_mhz",
    "l2_cache_bytes",
)
"""Fields that must match for a stored measurement of ``local`` to be reused (same CPU, same usable
cores, same RAM): the measured values describe that machine only. A clock read from the current
``cpu MHz`` (no max frequency available) is itself a drifting reading and is reused, not compared."""


@dataclass(frozen=True)
class LocalCpuIdentity:
    """What identifies this machine's CPU without measuring anything: model name (as ``local``'s
    ``name``), SIMD width in bits (as ``vector_width_bits``) and logical CPUs (``os.cpu_count()``)."""

    name: str
    vector_width_bits: int
    logical_cpus: int | None


def local_cpu_identity() -> LocalCpuIdentity:
    """:class:`LocalCpuIdentity` of this machine, from ``/proc/cpuinfo`` (the same fields and fallbacks as
    :func:`detect_local_cpu`, ~1 ms; nothing measured). Never raises."""
    machine = platform.machine().lower() or "unknown"
    cpuinfo = _parse_cpuinfo(_read_text(_CPUINFO))
    flags = set((cpuinfo.get("flags") or cpuinfo.get("features") or "").split())
    bits, _, _ = _vector_width(machine, flags)
    name = cpuinfo.get("model name") or platform.processor() or f"{machine} CPU"
    return LocalCpuIdentity(name=name, vector_width_bits=bits, logical_cpus=os.cpu_count())


@cache
def detect_local_cpu() -> HardwareSpec:
    """Spec of this machine's CPU (id ``local``, kind ``cpu``), detected and measured once per process.

    ``compute_units``: usable physical cores; ``peak_flops_per_s``: fp32 and fp64 from the formula of the
    module docstring (FLOP/s); ``memory_bytes``: total RAM (psutil); ``memory_bandwidth_bytes_per_s``:
    measured (:func:`measure_memory_bandwidth`, ≤ ~0.5 s); ``l2_cache_bytes``: total L2 over its
    instances (sysfs); ``tdp_w`` unknown (left out). Each value's origin is in ``sources``.
    Never raises for missing /proc or /sys fields: it falls back as documented. The service does not
    call this at every start: see :func:`local_cpu_spec`.
    """
    return _detect(stored=None)


def local_cpu_spec(stored: HardwareSpec | None) -> HardwareSpec:
    """Spec of ``local`` for the service: the measured values (memory bandwidth, and the fp32 peak when
    it had to be measured) come from ``stored``, the spec saved in the database at an earlier start,
    whenever that was measured on this machine (equal :data:`_IDENTITY_FIELDS`), so predictions on
    ``local`` do not change between restarts. Without a matching ``stored`` spec this is
    :func:`detect_local_cpu` (a fresh measurement). Never raises for missing /proc or /sys fields.
    """
    if stored is None:
        return detect_local_cpu()
    return _detect(stored=stored)


def _measured(spec: HardwareSpec, key: str) -> bool:
    return spec.sources.get(key, "").startswith("measured:")


def _detect(*, stored: HardwareSpec | None) -> HardwareSpec:
    """Detect the static facts; take the measured values from ``stored`` when it describes the same
    machine, else measure them now (see :func:`detect_local_cpu`, :func:`local_cpu_spec`)."""
    machine = platform.machine().lower() or "unknown"
    cpuinfo = _parse_cpuinfo(_read_text(_CPUINFO))
    flags = set((cpuinfo.get("flags") or cpuinfo.get("features") or "").split())
    sources: dict[str, str] = {}

    cores, sources["compute_units"] = _physical_cores()
    max_mhz, max_src, base_mhz, base_src = _frequencies_mhz(cpuinfo)
    bits, ports, vec_src = _vector_width(machine, flags)
    sources["vector_width_bits"] = vec_src
    caches = _cache_sizes()
    l2 = caches.get(2)
    if l2:
        sources["l2_cache_bytes"] = "/sys/devices/system/cpu/cpu*/cache/index*: level-2 size x instances"
    llc = caches.get(max(caches)) if caches else None
    memory = float(psutil.virtual_memory().total)
    sources["memory_bytes"] = "psutil.virtual_memory().total"
    name = cpuinfo.get("model name") or platform.processor() or f"{machine} CPU"
    identity = {
        "name": name, "architecture": machine, "compute_units": cores, "memory_bytes": memory,
        "vector_width_bits": bits, "boost_clock_mhz": max_mhz, "l2_cache_bytes": float(l2) if l2 else None,
    }
    # Without a max frequency the clock is the *current* one, which drifts between reads: a reading,
    # like the bandwidth, so it is compared by its source and the stored value reused.
    current_clock = max_mhz is not None and max_src.startswith(_CURRENT_CLOCK_SOURCE)
    keys = [k for k in _IDENTITY_FIELDS if not (current_clock and k == "boost_clock_mhz")]
    reuse = (
        stored is not None
        and all(getattr(stored, key) == identity[key] for key in keys)
        and (not current_clock or stored.sources.get("boost_clock_mhz") == max_src)
        and _measured(stored, "memory_bandwidth_bytes_per_s")
        and (max_mhz is not None or _measured(stored, "peak_flops_per_s.fp32"))
    )
    if reuse and current_clock:
        assert stored is not None
        max_mhz, base_mhz = stored.boost_clock_mhz, stored.base_clock_mhz
        base_src = stored.sources.get("base_clock_mhz", base_src)
    if max_mhz is not None:
        sources["boost_clock_mhz"] = max_src
    if base_mhz is not None:
        sources["base_clock_mhz"] = base_src
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    note = (
        f"; measured at {stamp} (the service keeps this measurement in the hardware row '{LOCAL_ID}' and "
        f"reuses it at every start while {', '.join(_IDENTITY_FIELDS)} stay the same)"
    )

    if max_mhz is not None:
        fp32 = cores * max_mhz * 1e6 * (bits / 32) * 2 * ports
        sources["peak_flops_per_s.fp32"] = (
            f"derived: {cores} cores x {max_mhz / 1000:.3g} GHz x {bits // 32} fp32 lanes x 2 (FMA) x "
            f"{ports} FMA port(s) (assumption: {ports} FMA unit(s) per core, see app/hardware/local.py)"
        )
    elif reuse:
        assert stored is not None
        fp32 = float(stored.peak_flops_per_s["fp32"])
        sources["peak_flops_per_s.fp32"] = stored.sources["peak_flops_per_s.fp32"]
    else:
        fp32 = _measure_matmul_flops(cores)
        sources["peak_flops_per_s.fp32"] = "measured: numpy float32 1024^3 matmul (clock unknown)" + note
    peaks = {"fp32": fp32, "fp64": fp32 / 2}
    sources["peak_flops_per_s.fp64"] = "derived: fp32 peak / 2 (half the vector lanes)"

    if reuse:
        assert stored is not None
        bandwidth = float(stored.memory_bandwidth_bytes_per_s)
        sources["memory_bandwidth_bytes_per_s"] = stored.sources["memory_bandwidth_bytes_per_s"]
    else:
        bw = measure_memory_bandwidth(threads=cores, llc_bytes=llc)
        bandwidth = bw.bytes_per_s
        llc_txt = f"last-level cache {llc / 2**20:.0f} MiB" if llc else "last-level cache unknown, 32 MiB assumed"
        sources["memory_bandwidth_bytes_per_s"] = (
            f"measured: numpy STREAM add a=b+c, float64, 3 x {bw.array_bytes / 2**20:.0f} MiB arrays "
            f"({llc_txt}), {bw.threads} thread(s), best of {bw.repetitions}, 24 bytes/element" + note
        )

    spec = HardwareSpec(
        id=LOCAL_ID,
        name=name,
        vendor=_vendor(cpuinfo),
        kind="cpu",
        peak_flops_per_s=peaks,
        memory_bytes=memory,
        memory_bandwidth_bytes_per_s=bandwidth,
        compute_units=cores,
        base_clock_mhz=base_mhz,
        boost_clock_mhz=max_mhz,
        l2_cache_bytes=float(l2) if l2 else None,
        vector_width_bits=bits,
        architecture=machine,
        sources=sources,
    )
    logger.info(
        "local CPU: %s, %d cores, %.1f GFLOP/s fp32 peak, %.1f GB/s %s",
        name,
        cores,
        fp32 / 1e9,
        bandwidth / 1e9,
        "(stored measurement reused)" if reuse else "measured",
    )
    return spec
