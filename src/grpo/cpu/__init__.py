"""The CPU speed layer: everything that exists only to make training fast on a CPU.

Nothing in the training loop imports it; the single-process and data-parallel
backends install it (grpo.backends), and a run with `cpu.enabled: false`
trains correctly without it, slower."""
