"""Calibration of job estimates by measured actuals (pure).

Actuals are grouped by the setting of their job (:class:`CalibrationGroup`: graph, hardware, precision,
software stack, device count, nodes): the predictor's error is not the same for fp32 and bf16, PyTorch eager
and CUDA graphs (whose launch gaps differ), one device and a multi-node all-reduce, so an actual calibrates
only the jobs of its own setting (other batch sizes, dataset sizes, epochs and optimizers of it share it).
For one group the log ratios ``r_i = ln(actual_i / predicted_i)`` of the recorded jobs are modelled as
``r_i ~ N(μ, σ²)`` with a prior ``μ ~ N(0, τ²)`` (the predictor is unbiased until shown otherwise). The
posterior mean of μ is the shrinkage estimate (normal–normal conjugate model, e.g. Gelman et al., *Bayesian
Data Analysis*, §2.5)::

    μ̂ = (n / σ²) r̄ / (n / σ² + 1 / τ²),    var(μ̂) = 1 / (n / σ² + 1 / τ²)

so one actual moves the estimate part of the way and many actuals move it to their mean. σ² is the
sample variance of the ``r_i`` pooled with :data:`PRIOR_SIGMA` over :data:`PRIOR_DOF` pseudo-observations
(a scaled-inverse-χ² prior), so that two equal actuals do not claim zero spread. The calibrated p50 is
``exp(μ̂) × predicted``; the p90 is ``p50 × exp(z₀.₉ √(σ² + var(μ̂)))`` (predictive spread of the next job),
never below the uncalibrated p90 ratio when there are no actuals.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Prior standard deviation of the log bias of the predictor on a calibration group: ±50 % is plausible
#: (the held-out whole-iteration errors of ``reports/evaluation.md`` are tens of per cent).
PRIOR_TAU = 0.5
#: Prior spread of one job's log ratio around the bias (run-to-run and data-loading variation): ~10 %.
PRIOR_SIGMA = 0.10
PRIOR_DOF = 2.0
#: 90th percentile of the standard normal.
Z90 = 1.2815515655446004
#: Largest plausible ratio between a job's measured duration and the model's estimate, either way. The
#: held-out errors of ``reports/evaluation.md`` are tens of per cent, so an actual 100x off the estimate is a
#: unit error, a hung job or a poisoning attempt, not a calibration signal: ``POST /v1/job-estimates/actuals``
#: refuses it per item (``implausible_actual``) and :func:`calibrate` clips stored ratios to this range.
MAX_ACTUAL_RATIO = 100.0
MAX_LOG_RATIO = math.log(MAX_ACTUAL_RATIO)


@dataclass(frozen=True, slots=True)
class CalibrationGroup:
    """The setting whose actuals calibrate each other: ``precision`` is the job's requested precision value
    (``"fp32"``, ``"bf16"``...), ``software_stack`` its stack value (``"pytorch-eager"``...), ``device_count``
    its data-parallel devices over ``nodes`` nodes. Stored as :attr:`key` (the keys of a refit's ``groups``)."""

    graph_id: str
    hardware_id: str
    precision: str
    software_stack: str
    device_count: int
    nodes: int

    @property
    def key(self) -> str:
        """The group as a string key, a JSON array ``[graph_id, hardware_id, precision, software_stack,
        device_count, nodes]`` (ids may hold any printable character, so no separator could be safe)."""
        return json.dumps([self.graph_id, self.hardware_id, self.precision, self.software_stack, self.device_count,
                           self.nodes], separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> CalibrationGroup | None:
        """The group of :attr:`key`; None for a key of another form: the ``"<graph_id>|<hardware_id>"`` of refits
        stored before groups had a setting, or the five-element ``[graph_id, hardware_id, precision,
        device_count, nodes]`` of refits stored before the software stack was part of it (their actuals of
        several settings pooled: they cannot calibrate one setting, and the next refit groups them by setting)."""
        try:
            parts = json.loads(key)
        except ValueError:
            return None
        if (not isinstance(parts, list) or len(parts) != 6 or not all(isinstance(p, str) for p in parts[:4])
                or not all(type(p) is int for p in parts[4:])):
            return None
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class Calibration:
    """``factor`` multiplies the model's p50; ``log_sd`` is the predictive spread (natural log) of a job's
    time around the calibrated p50; ``actuals`` how many measurements it rests on."""

    actuals: int
    factor: float
    log_sd: float

    def p50_p90(self, predicted_p50_s: float, predicted_p90_s: float) -> tuple[float, float]:
        """Calibrated (p50, p90) in s; without actuals the model's own (p50, p90)."""
        if self.actuals == 0:
            return predicted_p50_s, predicted_p90_s
        p50 = self.factor * predicted_p50_s
        return p50, p50 * math.exp(Z90 * self.log_sd)


UNCALIBRATED = Calibration(actuals=0, factor=1.0, log_sd=0.0)


@dataclass(frozen=True, slots=True)
class RatioStats:
    """Sufficient statistics of clipped log ratios: their count, sum and sum of squares. Two sets combine
    by addition (:meth:`plus`), so the retraining loop can store the refit of every recorded actual and
    serving add the actuals recorded since (:func:`app.estimates.service.job_calibrations`)."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    @classmethod
    def of(cls, log_ratios: Sequence[float]) -> RatioStats:
        """Stats of ``log_ratios`` = ln(actual / predicted), each clipped to ±:data:`MAX_LOG_RATIO` (rows
        stored before the per-item check, or by another path, can never push the factor or the spread to
        overflow); non-finite ratios are ignored."""
        rs = [min(max(r, -MAX_LOG_RATIO), MAX_LOG_RATIO) for r in log_ratios if math.isfinite(r)]
        return cls(n=len(rs), total=math.fsum(rs), total_sq=math.fsum(r * r for r in rs))

    def plus(self, other: RatioStats) -> RatioStats:
        """The stats of both sets."""
        return RatioStats(self.n + other.n, self.total + other.total, self.total_sq + other.total_sq)

    def minus(self, other: RatioStats) -> RatioStats:
        """The stats of this set without ``other`` (a subset of it: leave-one-out in O(1) per left-out
        actual). Raises ``ValueError`` when ``other`` holds more ratios than this set."""
        if other.n > self.n:
            raise ValueError(f"cannot remove {other.n} ratios from a set of {self.n}")
        return RatioStats(self.n - other.n, self.total - other.total, max(0.0, self.total_sq - other.total_sq))


def calibrate(log_ratios: Sequence[float]) -> Calibration:
    """The shrinkage calibration (module docstring) of ``log_ratios`` = ln(actual / predicted), clipped and
    filtered as :meth:`RatioStats.of`."""
    return calibrate_stats(RatioStats.of(log_ratios))


def calibrate_stats(stats: RatioStats) -> Calibration:
    """The shrinkage calibration (module docstring) from the sufficient statistics of the log ratios."""
    n = stats.n
    if n == 0:
        return UNCALIBRATED
    mean = stats.total / n
    ss = max(0.0, stats.total_sq - n * mean * mean)
    sigma2 = (ss + PRIOR_DOF * PRIOR_SIGMA**2) / (n - 1 + PRIOR_DOF)
    precision = n / sigma2 + 1 / PRIOR_TAU**2
    mu = (n / sigma2) * mean / precision
    return Calibration(actuals=n, factor=math.exp(mu), log_sd=math.sqrt(sigma2 + 1 / precision))
