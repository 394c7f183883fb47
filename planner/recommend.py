"""Reasons in words and the recommendation under optional SLOs."""

from __future__ import annotations

import dataclasses

from atoll.planner.context import cp_reason

GIB = 2**30


def _share(parts: dict[str, float]) -> list[tuple[str, float]]:
    total = sum(parts.values()) or 1.0
    return sorted(((k, v / total) for k, v in parts.items() if v > 0), key=lambda kv: -kv[1])


def explain(p) -> str:
    """Which resource binds this candidate: "EP16: decode bound by HBM reads of expert weights
    (41%); all-to-all over infiniband is 18% of the step"."""
    if not p.fits:
        m = p.memory
        return (f"{p.name}: does not fit, short by {m.shortfall / GIB:.1f} GiB per GPU "
                f"(weights {m.weights / GIB:.1f} + KV {m.kv_cache / GIB:.1f} GiB of {m.capacity / GIB:.1f})")
    if not p.sustainable:
        return (f"{p.name}: not sustainable at {p.offered_rate:g} requests/s: {p.overload}; "
                f"saturated it serves {p.arrival_rate:.3g} requests/s")
    d = _share(p.decode)
    text = f"{p.name}: decode bound by {d[0][0]} ({d[0][1]:.0%})"
    comm = [(k, v) for k, v in d[1:] if ("over" in k or "pipeline" in k) and v >= 0.01]
    if comm:
        text += f"; {comm[0][0]} is {comm[0][1]:.0%} of the step"
    elif len(d) > 1:
        text += f"; then {d[1][0]} ({d[1][1]:.0%})"
    pf = _share(p.prefill)
    text += f"; prefill bound by {pf[0][0]}"
    return text


def recommend(predictions, *, ttft_ms: float | None = None, tpot_ms: float | None = None):
    """(predictions annotated and sorted best first, recommended or None, reasons). Closed
    loop: the highest tokens/s/GPU wins. Open loop (a request rate): every layout that sustains
    the rate serves the same tokens/s, so the lowest TPOT wins."""
    def meets(p):
        return (ttft_ms is None or p.ttft_s * 1e3 <= ttft_ms) and (tpot_ms is None or p.tpot_s * 1e3 <= tpot_ms)

    open_loop = any(p.offered_rate is not None for p in predictions)
    score, what = ((lambda p: p.tokens_per_s_per_user, "tokens/s/user") if open_loop
                   else (lambda p: p.tokens_per_s_per_gpu, "tokens/s/GPU"))
    preds = [dataclasses.replace(p, meets_slo=meets(p), reason=explain(p)) for p in predictions]
    preds.sort(key=lambda p: (not p.fits, not p.sustainable, not p.meets_slo, -score(p), p.tpot_s))
    fitting = [p for p in preds if p.fits]
    serving = [p for p in fitting if p.sustainable]
    ok = [p for p in serving if p.meets_slo]
    reasons = []
    slo = " and ".join(x for x in (f"TTFT <= {ttft_ms:g} ms" if ttft_ms is not None else "",
                                   f"TPOT <= {tpot_ms:g} ms" if tpot_ms is not None else "") if x)
    if not fitting:
        worst = min(preds, key=lambda p: p.memory.shortfall) if preds else None
        reasons.append("no layout fits in GPU memory" +
                       (f"; closest is {worst.name}, short by {worst.memory.shortfall / GIB:.1f} GiB per GPU"
                        if worst else ""))
        return preds, None, reasons
    if not serving:
        most = max(fitting, key=lambda p: p.arrival_rate)
        reasons.append(f"no layout sustains {most.offered_rate:g} requests/s; the most is {most.name} at "
                       f"{most.arrival_rate:.3g} requests/s ({most.overload})")
        return preds, None, reasons
    if not ok:
        near = min(serving, key=lambda p: p.tpot_s)
        reasons.append(f"no layout meets {slo}; the fastest is {near.name} at TTFT {near.ttft_s * 1e3:.0f} ms, "
                       f"TPOT {near.tpot_s * 1e3:.1f} ms")
        return preds, None, reasons
    best = ok[0]
    ties = [p for p in ok[1:] if score(best) <= (1 + best.band) * score(p)]
    if ties:
        tied = {id(p) for p in ties}
        preds = [dataclasses.replace(p, tie=True) if id(p) in tied else p for p in preds]
        ok = [dataclasses.replace(p, tie=True) if id(p) in tied else p for p in ok]
        ties = ok[1:len(ties) + 1]
    among = f"{len(ok)} layouts that fit" + (f" and meet {slo}" if slo else "")
    if open_loop:
        among += f" and sustain {best.offered_rate:g} requests/s"
    line = (f"recommended {best.shown}: highest {what} ({score(best):.1f}) "
            f"among {among}, TPOT {best.tpot_s * 1e3:.1f} ms")
    if ties:
        names = ", ".join(f"{p.name} ({score(best) / score(p):.2f}x lower)"
                          for p in ties[:4]) + (f" and {len(ties) - 4} more" if len(ties) > 4 else "")
        line += (f"; a tie, not a choice: {names} within the predictions' +-{best.band:.0%} error "
                 f"(measure them before committing: atoll bench)")
    reasons.append(line)
    reasons.append(best.reason)
    if why_cp := cp_reason(best, preds):  # only where the search held cp layouts
        reasons.append(why_cp)
    if len(ok) > 1:
        second = ok[1]
        reasons.append(f"runner-up {second.reason} ({score(best) / score(second):.2f}x lower {what})")
    fastest = min(ok, key=lambda p: p.tpot_s)
    if fastest is not best:
        reasons.append(f"lowest latency: {fastest.name} at TPOT {fastest.tpot_s * 1e3:.1f} ms "
                       f"({fastest.tokens_per_s_per_user:.0f} tokens/s/user) but "
                       f"{fastest.tokens_per_s_per_gpu:.1f} tokens/s/GPU")
    overloaded = [p for p in fitting if not p.sustainable]
    if overloaded:
        reasons.append(f"{len(overloaded)} layouts cannot sustain the load, e.g. {overloaded[0].reason}")
    misfits = [p for p in preds if not p.fits]
    if misfits:
        reasons.append(f"{len(misfits)} layouts do not fit, e.g. {misfits[0].reason}")
    return preds, best, reasons
