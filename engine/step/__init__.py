"""The decode step: its abstraction, the compiled CPU step, CUDA graphs, and the policy of when
to compile."""
