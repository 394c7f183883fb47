"""atoll serve: an OpenAI-compatible HTTP server over a living engine."""
