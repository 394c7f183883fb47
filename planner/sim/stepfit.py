"""A model's engine steps on a calibrated machine, fitted from its measured ticks (`atoll calibrate
--steps MODEL`): the time of a tick against its shape (engine.batch.shape.StepShape).

    seconds = rows(r) + chunk_token_us x chunk tokens + ctx_kilotoken_us x decode positions / 1000
              + attended_kilotoken_us x (chunk token, position) pairs / 1000     (all in microseconds)

rows(r) is piecewise linear over the measured row counts (a compiled CPU step runs in buckets:
one row is its own graph, so the decode part is not one straight line), past the last one
extended along its last piece. The coefficients are non-negative least squares over every
tick measured (clip and refit). The simulator takes it, where the calibration holds the
model and layout, in place of the cost model's roofline: a measured step of this model on this
machine, not a micro-benchmark.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from atoll.errors import ConfigError

KNOTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class StepFit:
    rows: dict  # row count -> microseconds of a step of that many decoding rows (no chunk)
    chunk_token_us: float
    ctx_kilotoken_us: float
    attended_kilotoken_us: float
    samples: int = 0
    rel_rms: float = 0.0  # the fit's RMS error over the measured ticks, relative to their mean

    def seconds(self, rows: int, chunk_tokens: float, ctx_sum: float, attended_sum: float) -> float:
        return 1e-6 * (self._rows_us(rows) + self.chunk_token_us * chunk_tokens
                       + self.ctx_kilotoken_us * ctx_sum / 1000 + self.attended_kilotoken_us * attended_sum / 1000)

    def _rows_us(self, r: float) -> float:
        knots = sorted(self.rows)
        values = [self.rows[k] for k in knots]
        if len(knots) == 1:
            return values[0]
        i = min(max(bisect.bisect_right(knots, r) - 1, 0), len(knots) - 2)
        a, b = knots[i], knots[i + 1]
        return values[i] + (values[i + 1] - values[i]) * (r - a) / (b - a)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "StepFit":
        try:
            rows = {int(k): float(v) for k, v in d["rows_us"].items()}
            return cls(rows=rows, chunk_token_us=float(d["chunk_token_us"]),
                       ctx_kilotoken_us=float(d["ctx_kilotoken_us"]),
                       attended_kilotoken_us=float(d["attended_kilotoken_us"]), samples=int(d.get("samples", 0)),
                       rel_rms=float(d.get("rel_rms", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"{where} must hold rows_us {{rows: us}}, chunk_token_us, ctx_kilotoken_us and "
                              "attended_kilotoken_us") from None

    def to_dict(self) -> dict:
        return {"rows_us": {int(k): round(float(v), 1) for k, v in sorted(self.rows.items())},
                "chunk_token_us": round(float(self.chunk_token_us), 3),
                "ctx_kilotoken_us": round(float(self.ctx_kilotoken_us), 3),
                "attended_kilotoken_us": round(float(self.attended_kilotoken_us), 4), "samples": int(self.samples),
                "rel_rms": round(float(self.rel_rms), 4)}


def _hats(rows: np.ndarray, knots: list[int]) -> np.ndarray:
    """Each tick's weights on the knots: linear interpolation between the two around its rows."""
    out = np.zeros((rows.size, len(knots)))
    for n, r in enumerate(rows.tolist()):
        i = min(max(bisect.bisect_right(knots, r) - 1, 0), len(knots) - 2)
        a, b = knots[i], knots[i + 1]
        w = (r - a) / (b - a)
        out[n, i], out[n, i + 1] = 1 - w, w
    return out


def fit(samples: list[tuple[int, float, float, float, float]]) -> StepFit:
    """samples: (rows, chunk tokens, decode positions, chunk (token, position) pairs, seconds) per tick."""
    if len(samples) < 8:
        raise ValueError(f"{len(samples)} ticks: too few to fit a step")
    x = np.array(samples, dtype=float)
    top = x[:, 0].max()
    knots = [k for k in KNOTS if k <= top] + [k for k in KNOTS if k > top][:1]
    a = np.hstack([_hats(x[:, 0], knots), x[:, 1:2], x[:, 2:3] / 1000, x[:, 3:4] / 1000])
    y = x[:, 4] * 1e6
    keep = np.ones(a.shape[1], bool)
    keep[:len(knots)] = a[:, :len(knots)].any(axis=0)  # knots no tick reaches stay out of the fit
    coef = np.zeros(a.shape[1])
    for _ in range(a.shape[1]):  # non-negative least squares: refit without the negative terms
        sol = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        coef[:] = 0
        coef[keep] = sol
        neg = coef < 0
        if not neg.any():
            break
        keep &= ~neg
    n = len(knots)
    rows = {k: coef[i] for i, k in enumerate(knots) if a[:, i].any()}
    err = a @ coef - y
    return StepFit(rows=rows, chunk_token_us=coef[n], ctx_kilotoken_us=coef[n + 1],
                   attended_kilotoken_us=coef[n + 2], samples=len(samples),
                   rel_rms=float(np.sqrt((err ** 2).mean()) / y.mean()))
