"""`atoll topo`: print a topology (preset, YAML file or discovered) and its NVLink islands."""

from __future__ import annotations

import json
import sys

from atoll import topologies as T
from atoll.errors import ConfigError
from atoll.topologies.discover import gpu_spec_for


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("topo", help="show a cluster topology and its NVLink islands",
                              description="atoll topo NAME --nodes N | atoll topo --discover | "
                                          "atoll topo --from-smi FILE | atoll topo --ray")
    p.add_argument("name", nargs="?", help="preset name or topology YAML file")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes")
    p.add_argument("--discover", action="store_true", help="this machine: NVML, else nvidia-smi, else CPU")
    p.add_argument("--from-smi", metavar="FILE", help="parse saved `nvidia-smi topo -m` output ('-': stdin)")
    p.add_argument("--ray", action="store_true", help="nodes and GPUs of the running Ray cluster")
    p.add_argument("--gpu", default=None, help="GPU name for --from-smi figures, e.g. H100")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: must be at least 1")
    if args.list:
        for name in T.preset_names():
            print(f"{name:12s} {T.load_topology(name).describe()}")
        return 0
    sources = sum(bool(x) for x in (args.name, args.discover, args.from_smi, args.ray))
    if sources != 1:
        raise ConfigError("give exactly one of NAME, --discover, --from-smi FILE, --ray "
                          f"(presets: {', '.join(T.preset_names())})")
    if args.gpu and not args.from_smi:
        raise ConfigError(f"--gpu {args.gpu} applies only to --from-smi (a preset or YAML names its GPU)")
    nodes = args.nodes or 1
    if args.discover:
        topo = T.discover(nodes=nodes)
    elif args.from_smi:
        where = "stdin" if args.from_smi == "-" else args.from_smi
        try:
            if args.from_smi == "-":
                text = sys.stdin.read()
            else:
                with open(args.from_smi, encoding="utf-8") as f:
                    text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read {where}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not text: expected the output of `nvidia-smi topo -m`") from None
        if "\0" in text:
            raise ConfigError(f"{where} is not text: expected the output of `nvidia-smi topo -m`")
        topo = T.topology_from_smi(text, nodes=nodes, gpu=gpu_spec_for(args.gpu) if args.gpu else None)
    elif args.ray:
        topo = T.topology_from_ray()
    else:
        topo = T.load_topology(args.name, nodes=args.nodes)
    if args.format == "json":
        json.dump(to_dict(topo), sys.stdout, indent=1)
        print()
    else:
        print(describe(topo))
    return 0


def _ranges(gpus: list[int]) -> str:
    out, start = [], None
    for i, g in enumerate(gpus):
        if start is None:
            start = g
        if i + 1 == len(gpus) or gpus[i + 1] != g + 1:
            out.append(f"{start}-{g}" if g > start else str(g))
            start = None
    return ",".join(out)


def _island_text(topo, island) -> str:
    by_node: dict[int, list[int]] = {}
    for n, g in island:
        by_node.setdefault(n, []).append(g)
    return " + ".join(f"{topo.nodes[n].name}:{_ranges(gs)}" for n, gs in by_node.items())


def describe(topo) -> str:
    g = topo.gpu
    fp8 = f", {g.fp8_tflops:g} fp8" if g.fp8_tflops else ", no fp8"
    lines = [topo.describe(),
             f"GPU      {g.name}: {g.memory_gib:.1f} GiB at {g.hbm_tb_s:g} TB/s, {g.bf16_tflops:g} TFLOPS bf16{fp8}",
             f"island   {topo.island_link}",
             f"node     {topo.node_link}",
             f"network  {topo.network}"]
    if topo.notes:
        lines.append(f"notes    {topo.notes}")
    islands = topo.islands
    shown = islands if len(islands) <= 16 else islands[:16]
    for i, isl in enumerate(shown):
        lines.append(f"island {i}: {len(isl)} GPU(s)  {_island_text(topo, isl)}")
    if len(islands) > len(shown):
        lines.append(f"... {len(islands) - len(shown)} more islands")
    return "\n".join(lines)


def to_dict(topo) -> dict:
    def link(x):
        return {"kind": x.kind, "gb_s": x.gb_s, "latency_us": x.latency_us, "shared": x.shared}

    g = topo.gpu
    return {"name": topo.name, "nodes": [n.name for n in topo.nodes], "gpus_per_node": topo.gpus_per_node,
            "gpu": {"name": g.name, "memory_gib": g.memory_gib, "hbm_tb_s": g.hbm_tb_s,
                    "bf16_tflops": g.bf16_tflops, "fp8_tflops": g.fp8_tflops},
            "links": {"island": link(topo.island_link), "node": link(topo.node_link),
                      "network": link(topo.network)},
            "islands": [[list(gid) for gid in isl] for isl in topo.islands], "notes": topo.notes}
