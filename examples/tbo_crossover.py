"""The planner's two-batch overlap by step size (planner/two_batch.py): an MoE layer's decode step
as one batch over as two halves, at several tokens a GPU, and the crossover, beside SGLang's
published figures. DeepSeek-V3 at DP16EP16 on 2 x 8 H200, and SGLang's own deployment shape
(decode at DP72EP72 on 9 x 8 H100, 2000-token prompts). No torch: the cost model only.

    python examples/tbo_crossover.py
"""

from atoll.models.presets import resolve_model
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.planner import Workload, two_batch
from atoll.planner.cost import CostModel
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology

SIZES = [16, 32, 64, 128, 256, 512, 1024]
CASES = [("dgx-h200", 2, "DP16EP16", {}), ("dgx-h100", 9, "DP72EP72", dict(isl=2000, osl=100))]


def main() -> None:
    _, config = resolve_model("DeepSeek-V3")
    sglang = ", ".join(f"{n}: {r:.2f}" for n, r in two_batch.SGLANG_DECODE.items())
    print(f"DeepSeek-V3 decode, an MoE layer one batch / two halves (above 1: TBO faster); SGLang measured {sglang}")
    print(f"{'deployment':>26} " + " ".join(f"{n:>6}" for n in SIZES) + "  crossover")
    for topology, nodes, layout, workload in CASES:
        topo, lay = load_topology(topology, nodes=nodes), Layout.parse(layout)
        cm = CostModel(config, shapes(config), topo, Workload(**workload).resolved(config), lay,
                       Placement.build(lay, topo, allow_cross_island=True))
        ratios = " ".join(f"{two_batch.forced_ratio(cm, n):>6.2f}" for n in SIZES)
        print(f"{layout + ' on ' + str(nodes) + ' x ' + topology:>26} {ratios}  {two_batch.crossover(cm, SIZES)}")


if __name__ == "__main__":
    main()
