"""Speculative decoding's figures, from the per-request metrics the engine writes
(spec_steps, spec_drafted, spec_accepted): the acceptance rate (accepted drafts over drafted
tokens) and the mean accepted length (tokens a verify step gives a sequence: its accepted
drafts and the target's own token, as vLLM counts it). Shared by generate's closing line,
the bench and the server's /metrics."""

from __future__ import annotations


def summarize(metrics: list[dict]) -> dict | None:
    """The totals and rates over these requests' metrics; None when none ran speculation."""
    rows = [m for m in metrics if "spec_drafted" in m]
    if not rows:
        return None
    steps = sum(m["spec_steps"] for m in rows)
    drafted = sum(m["spec_drafted"] for m in rows)
    accepted = sum(m["spec_accepted"] for m in rows)
    return {"steps": steps, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0}


def describe(metrics: list[dict]) -> str:
    """The closing line's tail: ", speculative: acceptance 41.2% (...), mean accepted length 2.24"."""
    s = summarize(metrics)
    if s is None:
        return ""
    return (f", speculative: acceptance {s['acceptance_rate']:.1%} ({s['accepted']} of {s['drafted']} drafted), "
            f"mean accepted length {s['mean_accepted_length']:.2f} over {s['steps']} verify steps")
