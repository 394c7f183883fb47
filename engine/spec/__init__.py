"""Speculative decoding: the Drafter base, the drafters by method name, and their counters."""
