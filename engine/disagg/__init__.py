"""Disaggregated prefill and decode: the decision (which engine computes a prompt), the KV
transfer between engines, and the ranks' hand-off."""
