"""The driver: `LLM`, the living engine (submit, stream, abort) and its disaggregated form,
and one-shot evaluation."""
