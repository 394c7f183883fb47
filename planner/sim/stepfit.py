"""A model's engine steps on a calibrated machine, fitted from its measured ticks (`atoll calibrate
--steps MODEL`): the time of a tick against its shape (engine.batch.shape.StepShape), in two
parts, as the engine runs them two ways:

    decode-only tick:   rows(r) + ctx_kilotoken_us x decode keys / 1000
    tick with chunks:   chunk_base_us + chunk_row_us x r + chunk_token_us x chunk tokens
                        + chunk_ctx_kilotoken_us x decode positions / 1000
                        + attended_kilotoken_us x (chunk token, position) pairs / 1000

(all in microseconds). A decode-only tick's keys are the positions its rows attend to, or, where
that fits the ticks better (decode_keys "padded"), the keys the compiled CPU step reads: every row
up to the longest row's context, padded to a power of two of blocks, so that one long sequence
beside short ones costs what it costs there. A decode-only tick is the decode step (compiled on a CPU, captured on a
GPU), which runs in buckets: rows(r) is piecewise linear over the measured row counts and never
falls as they grow, past the last one extended along its last piece. A tick carrying prompt chunks runs the plain step, its
rows beside the chunk tokens at a per-row cost of their own; so does a decode-only tick whose rows'
contexts differ so much that the compiled CPU step leaves it to the eager step (they split into
groups, layers.context_groups: a long sequence decoding beside short ones), where the calibration
measured such ticks beside compiled ones (eager_decode). The compiled step pads its rows to a
bucket (17 rows run as 32): rows(r) is read at r or at its bucket, whichever fits the ticks better
(decode_rows). Each part's coefficients are
non-negative least squares over its ticks (clip and refit), Huber-weighted so that a few
ticks slowed by something else on the machine do not pull it. The simulator takes it, where the
calibration holds the model and layout, in place of the cost model's roofline: a measured step
of this model on this machine, not a micro-benchmark.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from atoll.errors import ConfigError

KNOTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class StepFit:
    rows: dict  # row count -> microseconds of a decode-only tick of that many rows
    chunk_token_us: float
    ctx_kilotoken_us: float
    attended_kilotoken_us: float
    samples: int = 0
    rel_rms: float = 0.0  # the fit's RMS error over the measured ticks, relative to their mean
    # the fit's median absolute error relative to the median tick: what a typical tick misses by,
    # unmoved by the few ticks another process on the machine slowed (which rel_rms counts squared)
    rel_median: float = 0.0
    # ticks with prompt chunks; None (a fit written before they had their own part): rows(r) too
    chunk_base_us: float | None = None
    chunk_row_us: float = 0.0
    chunk_ctx_kilotoken_us: float = 0.0
    # what a decode-only tick's context term counts: "sum", every row's own context; "padded",
    # what the compiled CPU step reads (every row up to the longest, its blocks padded to a power of two)
    decode_keys: str = "sum"
    # whether decode-only ticks the compiled step left to the eager step (their rows' contexts
    # split into groups: layers.context_groups) were measured beside compiled ones, and are timed
    # as the plain step, fitted with the ticks carrying chunks
    eager_decode: bool = False
    # what a decode-only tick's rows(r) is read at: "rows", r itself; "bucket", the rows the
    # compiled step pads r to (row_bucket: 17 rows run as 32)
    decode_rows: str = "rows"

    def seconds(self, rows: int, chunk_tokens: float, ctx_sum: float, attended_sum: float,
                ctx_padded: float | None = None, split: bool = False) -> float:
        """A tick's seconds; ctx_padded: the keys a compiled decode step reads (StepShape.ctx_padded);
        split: a decode-only tick whose rows' contexts split into groups (the eager step's)."""
        plain = bool(chunk_tokens) or (split and self.eager_decode)
        if not plain and self.decode_keys == "padded" and ctx_padded is not None:
            ctx_sum = ctx_padded
        if not plain and self.decode_rows == "bucket":
            rows = row_bucket(rows)
        if plain and self.chunk_base_us is not None:
            return 1e-6 * (self.chunk_base_us + self.chunk_row_us * rows + self.chunk_token_us * chunk_tokens
                           + self.chunk_ctx_kilotoken_us * ctx_sum / 1000
                           + self.attended_kilotoken_us * attended_sum / 1000)
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
            chunk = d.get("chunk")
            return cls(rows=rows, chunk_token_us=float(d["chunk_token_us"]),
                       ctx_kilotoken_us=float(d["ctx_kilotoken_us"]),
                       attended_kilotoken_us=float(d["attended_kilotoken_us"]), samples=int(d.get("samples", 0)),
                       rel_rms=float(d.get("rel_rms", 0.0)), rel_median=float(d.get("rel_median", 0.0)),
                       chunk_base_us=None if chunk is None else float(chunk["base_us"]),
                       chunk_row_us=0.0 if chunk is None else float(chunk["row_us"]),
                       chunk_ctx_kilotoken_us=0.0 if chunk is None else float(chunk["ctx_kilotoken_us"]),
                       decode_keys=str(d.get("decode_keys", "sum")), eager_decode=bool(d.get("eager_decode", False)),
                       decode_rows=str(d.get("decode_rows", "rows")))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"{where} must hold rows_us {{rows: us}}, chunk_token_us, ctx_kilotoken_us and "
                              "attended_kilotoken_us, and chunk {base_us, row_us, ctx_kilotoken_us}") from None

    def to_dict(self) -> dict:
        out = {"rows_us": {int(k): round(float(v), 1) for k, v in sorted(self.rows.items())},
               "chunk_token_us": round(float(self.chunk_token_us), 3),
               "ctx_kilotoken_us": round(float(self.ctx_kilotoken_us), 3),
               "attended_kilotoken_us": round(float(self.attended_kilotoken_us), 4), "samples": int(self.samples),
               "rel_rms": round(float(self.rel_rms), 4), "rel_median": round(float(self.rel_median), 4),
               "decode_keys": self.decode_keys}
        if self.eager_decode:
            out["eager_decode"] = True
        if self.decode_rows != "rows":
            out["decode_rows"] = self.decode_rows
        if self.chunk_base_us is not None:
            out["chunk"] = {"base_us": round(float(self.chunk_base_us), 1), "row_us": round(float(self.chunk_row_us), 2),
                            "ctx_kilotoken_us": round(float(self.chunk_ctx_kilotoken_us), 3)}
        return out


def _ramps(rows: np.ndarray, knots: list[int]) -> np.ndarray:
    """Each tick's weights on the step at the first knot and on each rise between two knots (0
    below the rise, 1 above it, linear between): non-negative weights make rows(r) a
    non-decreasing piecewise linear function, as a step of more rows never takes less."""
    out = np.ones((rows.size, len(knots)))
    for j in range(1, len(knots)):
        a, b = knots[j - 1], knots[j]
        out[:, j] = np.clip((rows - a) / (b - a), 0.0, 1.0)
    return out


def _nnls(a: np.ndarray, y: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Least squares of a @ coef = y with coef >= 0: refit without the negative terms."""
    coef = np.zeros(a.shape[1])
    for _ in range(a.shape[1]):
        sol = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        coef[:] = 0
        coef[keep] = sol
        neg = coef < 0
        if not neg.any():
            break
        keep &= ~neg
    return coef


def _robust(a: np.ndarray, y: np.ndarray, rounds: int = 6) -> np.ndarray:
    """Non-negative least squares with Huber weights, refitted: a tick slowed by something
    outside the step (another process on its cores, a page fault) counts as far as HUBER
    median absolute residuals and no further, so a few outliers do not pull the step."""
    w = np.ones(len(y))
    coef = _nnls(a, y, np.ones(a.shape[1], bool))
    for _ in range(rounds):
        r = a @ coef - y
        scale = HUBER * max(float(np.median(np.abs(r))), 1e-9)
        w = np.minimum(1.0, scale / np.maximum(np.abs(r), 1e-12))
        sw = np.sqrt(w)
        coef = _nnls(a * sw[:, None], y * sw, np.ones(a.shape[1], bool))
    return coef


HUBER = 2.0  # residuals past this many median absolute residuals count linearly, not squared


def fit(samples: list[tuple]) -> StepFit:
    """samples: (rows, chunk tokens, decode positions, chunk (token, position) pairs, seconds[,
    keys the compiled decode step read[, whether the compiled step ran it]]) per tick. With the
    keys read, a decode-only tick is fitted on the positions each way, and the one that fits the
    ticks better is kept (decode_keys): the compiled CPU step reads every row up to the longest
    row, padded. Decode-only ticks the eager step ran beside compiled ones (rows whose contexts
    split into groups) are fitted with the ticks carrying chunks, as the plain step (eager_decode)."""
    if len(samples) < 8:
        raise ValueError(f"{len(samples)} ticks: too few to fit a step")
    x = np.array([s[:5] for s in samples], dtype=float)
    padded = np.array([s[5] if len(s) > 5 else s[2] for s in samples], dtype=float)
    graph = [s[6] if len(s) > 6 else None for s in samples]
    decode_only = x[:, 1] == 0
    eager = np.array([g is False for g in graph]) & decode_only
    eager_decode = bool(eager.any() and any(g is True for g, d in zip(graph, decode_only) if d))
    plain = ~decode_only | eager if eager_decode else ~decode_only
    keys = [("sum", x[:, 2])] + ([("padded", padded)] if not np.allclose(padded[~plain], x[~plain, 2]) else [])
    buckets = np.array([row_bucket(r) for r in x[:, 0]], dtype=float)
    rows = [("rows", x[:, 0])] + ([("bucket", buckets)] if not np.array_equal(buckets[~plain], x[~plain, 0]) else [])
    fits = [_fit(x, k, key_mode, r, row_mode, plain, eager_decode) for key_mode, k in keys for row_mode, r in rows]
    return min(fits, key=lambda f: f.rel_median)


def row_bucket(rows: float) -> int:
    """The rows a compiled decode step runs `rows` at: the next power of two (engine.batch.shape.seq_buckets)."""
    return 1 << max(0, int(math.ceil(rows)) - 1).bit_length()


def _fit(x: np.ndarray, keys: np.ndarray, decode_keys: str, rows_of: np.ndarray, decode_rows: str,
         plain: np.ndarray, eager_decode: bool) -> StepFit:
    only = ~plain
    decode, chunked = x[only], x[~only]
    if len(decode) < 2 or len(chunked) < 5:
        raise ValueError(f"{len(decode)} decode-only and {len(chunked)} ticks with prompt chunks: too few to fit a step")
    r = rows_of[only]
    low, top = r.min(), r.max()
    # past the top measured row count the step is extended along its last piece
    knots = [k for k in KNOTS if low <= k <= top] + ([k for k in KNOTS if k > top][:1] if top not in KNOTS else [])
    knots = [k for k in KNOTS if k < low][-1:] + knots if knots[0] > low else knots
    a = np.hstack([_ramps(r, knots), keys[only, None] / 1000])
    dec = _robust(a, decode[:, 4] * 1e6)
    b = np.hstack([np.ones((len(chunked), 1)), chunked[:, 0:2], chunked[:, 2:4] / 1000])
    chk = _robust(b, chunked[:, 4] * 1e6)
    n = len(knots)
    rows = dict(zip(knots, np.cumsum(dec[:n]).tolist()))
    err = np.concatenate([a @ dec - decode[:, 4] * 1e6, b @ chk - chunked[:, 4] * 1e6])
    return StepFit(rows=rows, chunk_token_us=chk[2], ctx_kilotoken_us=dec[n], attended_kilotoken_us=chk[4],
                   samples=len(x), rel_rms=float(np.sqrt((err ** 2).mean()) / (x[:, 4].mean() * 1e6)),
                   rel_median=float(np.median(np.abs(err)) / (np.median(x[:, 4]) * 1e6)),
                   chunk_base_us=chk[0], chunk_row_us=chk[1], chunk_ctx_kilotoken_us=chk[3], decode_keys=decode_keys,
                   eager_decode=eager_decode, decode_rows=decode_rows)
