"""The scheduling half's requests and batches: requests and their stop rules, sequences, the
continuous-batching scheduler and the pipeline's lanes, and the tokenizer. Plain Python over
token ids and block ids: no torch, no ranks (the import contract checks it), so the
planner's simulator runs the same scheduler the engine serves with."""
