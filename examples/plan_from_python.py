"""Ask the planner from Python: which layout for DeepSeek-V3 on two DGX H200 nodes?

    python examples/plan_from_python.py

Prints the recommended layout per concurrency, the reasons, and where each rank of the
recommended layout goes (the Placement the launchers consume).
"""

from atoll.planner import Workload, plan_layouts
from atoll.topologies import load_topology


def main() -> None:
    cluster = load_topology("dgx-h200", nodes=2)
    for concurrency in (1, 64, 1024):
        plan = plan_layouts("DeepSeek-V3", cluster, Workload(isl=1024, osl=256, concurrency=concurrency,
                                                             dtype="fp8"))
        best = plan.recommended
        print(f"concurrency {concurrency}: {best.name}, TPOT {best.tpot_s * 1e3:.1f} ms, "
              f"{best.tokens_per_s_per_gpu:.1f} tok/s/GPU")
        for reason in plan.reasons:
            print("   ", reason)
        nodes = {plan.placement.node_of(r) for r in range(best.layout.world_size)}
        print(f"    rank 0 -> node {plan.placement.node_of(0)} gpu {plan.placement.gpu_of(0)}; "
              f"{len(nodes)} node(s) used")


if __name__ == "__main__":
    main()
