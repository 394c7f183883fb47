"""One rank of an engine: the model runner, EngineCore's tick, and the loops that drive it."""
