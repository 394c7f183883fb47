"""Names of the cost model's categories: each second of a predicted step is charged to one."""

WEIGHTS = "HBM reads of weights"
EXPERTS = "HBM reads of expert weights"
KV = "HBM reads of KV cache"
COMPUTE = "compute"
KERNELS = "kernel launch floors"
OVERHEAD = "per-op launch/dispatch time (calibrated)"
OVERLAP = "MoE exchange hidden by two-batch overlap"  # negative: seconds taken off
