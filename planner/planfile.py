"""Plan files: what `atoll plan --save plan.yaml` writes and `atoll generate --plan` runs.

    atoll_plan: 1
    model: {name: Qwen3-30B-A3B, shapes: {model_type: qwen3_moe, hidden_size: 2048, ...}}
    layout: TP4EP4
    replicas: 1
    topology: {name: dgx-h200, node_names: [node0, node1], gpus_per_node: 8, gpu: {...},
               islands: [[[0, 0], [0, 1], ...], ...], links: {island: {...}, node: {...}, network: {...}}}
    placement: [{rank: 0, node: node0, gpu: 0, island: 0}, ...]
    predictions: {ttft_ms: ..., tpot_ms: ..., tokens_per_s_per_gpu: ..., tokens_per_s_per_user: ...,
                  binding: "TP4EP4: decode bound by ..."}
    workload: {isl: 1024, osl: 256, concurrency: 64, dtype: bf16, kv_dtype: bf16}
    reasons: [...]

The topology is written inline (every node, island and link), so a plan runs the same on
any machine whatever presets it has. `shapes` holds the model's shape fields: a run refuses a
plan made for another model. Every error a bad file can cause is one line naming the file.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from atoll.errors import AtollError, ConfigError
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.planner.sim.deploy import Deployment
from atoll.topologies.load import read_yaml
from atoll.topologies.schema import GpuSpec, Link, Node, Topology

VERSION = 1
# the ModelConfig fields a layout and its weights depend on
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "first_k_dense_replace", "kv_lora_rank", "q_lora_rank")


def model_shapes(config) -> dict:
    return {f: getattr(config, f) for f in SHAPE_FIELDS}


@dataclass(frozen=True)
class SavedPlan:
    model: str
    shapes: dict
    layout: Layout
    replicas: int
    topology: object  # Topology
    placement: Placement
    predictions: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    deployment: dict = field(default_factory=dict)  # the SLO search's whole deployment (planner.sim.deploy)

    @property
    def islands(self) -> tuple[int, ...]:
        """rank -> island id, for parallel.mesh.ContextOptions."""
        return self.placement.island

    @property
    def nodes(self) -> tuple[int, ...]:
        """rank -> node index, for parallel.mesh.ContextOptions."""
        return tuple(n for n, _ in self.placement.slots)

    def check_model(self, config, where: str = "--model") -> None:
        """Refuse a model whose shapes differ from the plan's, in one line."""
        have = model_shapes(config)
        diff = [f"{k}={have.get(k)!r} (plan: {v!r})" for k, v in self.shapes.items() if have.get(k) != v]
        if diff:
            raise ConfigError(f"the plan is for {self.model}, but {where} differs: {', '.join(diff[:3])}")

    def engine_options(self) -> dict:
        """The engine options the plan chose (EngineConfig's names): EPLB, its spare slots, TBO."""
        w = self.workload or {}
        names = {"eplb": "enable_eplb", "redundant_experts": "num_redundant_experts",
                 "two_batch_overlap": "enable_two_batch_overlap"}
        return {names[k]: w[k] for k in names if w.get(k)}

    def summary(self) -> str:
        """One line: layout, where the ranks go, the predictions."""
        nodes = self.placement.node_names
        used = [nodes[n] for n in self.placement.nodes]
        p = self.predictions
        pred = ""
        if p:
            pred = (f"; predicted TTFT {p['ttft_ms']:.1f} ms, TPOT {p['tpot_ms']:.2f} ms, "
                    f"{p['tokens_per_s_per_gpu']:.1f} tok/s/GPU")
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in self.engine_options().items()]
        chosen = f" with {' '.join(flags)}" if flags else ""
        return (f"plan: {self.layout}{chosen} on {len(used)} node(s) of {self.topology.name} "
                f"({', '.join(used)}; {len(set(self.placement.island))} island(s)){pred}")

    def to_dict(self) -> dict:
        pl = self.placement
        return {
            "atoll_plan": VERSION, "model": {"name": self.model, "shapes": dict(self.shapes)},
            "layout": str(self.layout), "replicas": self.replicas,
            "topology": topology_to_dict(self.topology),
            "placement": [{"rank": r, "node": pl.node_names[n], "gpu": g, "island": pl.island[r]}
                          for r, (n, g) in enumerate(pl.slots)],
            "predictions": dict(self.predictions), "workload": dict(self.workload),
            "reasons": list(self.reasons),
        } | ({"deployment": dict(self.deployment)} if self.deployment else {})


def from_plan(plan, config) -> SavedPlan:
    """The planner's Plan (its recommendation) as a SavedPlan; `config`: its ModelConfig."""
    best = plan.recommended
    if best is None or plan.placement is None:
        raise ConfigError(f"no plan to save: {plan.reasons[0] if plan.reasons else 'nothing was recommended'}")
    w = plan.workload
    preds = {"ttft_ms": best.ttft_s * 1e3, "tpot_ms": best.tpot_s * 1e3,
             "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu,
             "tokens_per_s_per_user": best.tokens_per_s_per_user, "binding": best.reason}
    return SavedPlan(model=plan.model, shapes=model_shapes(config), layout=best.layout, replicas=best.replicas,
                     topology=plan.topology, placement=plan.placement, predictions=preds,
                     workload={"isl": w.isl, "osl": w.osl, "concurrency": w.concurrency, "dtype": w.dtype,
                               "kv_dtype": w.kv_dtype} | {k: getattr(w, k) for k in ("request_rate", "expert_imbalance")
                                                           if getattr(w, k) is not None} | dict(best.options),
                     reasons=tuple(plan.reasons))


def from_search(result, config, topology, *, model: str, workload: dict) -> SavedPlan:
    """The SLO search's deployment (planner/sim/search.py) as a SavedPlan: the layout of its
    engines (xPyD: the decode engines'), placed from the cluster's first GPU, and the whole
    deployment for `atoll serve --plan`."""
    best = result.best
    if best is None:
        raise ConfigError(f"no plan to save: {result.reasons[0]}")
    d = best.deployment
    layout = Layout.parse(d.decode if d.disaggregated else d.layout)
    t = best.best
    preds = {"ttft_ms": t.serve["ttft_ms"]["p90"], "tpot_ms": t.serve["tpot_ms"]["p90"],
             "tokens_per_s_per_gpu": t.point(best.gpus)[1], "tokens_per_s_per_user": t.point(best.gpus)[0],
             "goodput_per_gpu": best.goodput_per_gpu, "attainment": t.attainment, "percentile": "p90"}
    return SavedPlan(model=model, shapes=model_shapes(config), layout=layout,
                     replicas=d.decode_replicas if d.disaggregated else d.replicas, topology=topology,
                     placement=Placement.build(layout, topology, allow_cross_island=True), predictions=preds,
                     workload=dict(workload) | {"slos_ms": dict(result.target.slos), "request_rate": result.target.rate},
                     reasons=tuple(result.reasons), deployment=asdict(d))


class _Flow(list):
    """A list written on one line."""


class _FlowMap(dict):
    """A mapping written on one line."""


def _dumper():
    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    Dumper.add_representer(_FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
    return Dumper


def plan_yaml(plan: SavedPlan) -> str:
    d = plan.to_dict()
    topo = d["topology"]
    topo["node_names"] = _Flow(topo["node_names"])
    topo["gpu"] = _FlowMap(topo["gpu"])
    topo["islands"] = [_Flow(_Flow(g) for g in isl) for isl in topo["islands"]]
    topo["links"] = {k: _FlowMap(v) for k, v in topo["links"].items()}
    d["placement"] = [_FlowMap(row) for row in d["placement"]]
    return yaml.dump(d, Dumper=_dumper(), sort_keys=False, width=120)


def save_plan(plan: SavedPlan, path) -> None:
    try:
        Path(path).write_text(plan_yaml(plan), encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write the plan to {path}: {e.strerror}") from None


def check_save_path(path) -> None:
    """Before any work: --save must name a file in a writable directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"--save {path}: is a directory; give a file such as {p / 'plan.yaml'}")
    if not p.parent.is_dir():
        raise ConfigError(f"--save {path}: the directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"--save {path}: not writable")


# ---- topology inline --------------------------------------------------------------------

def topology_to_dict(t) -> dict:
    gpus = {n.gpus for n in t.nodes}
    return {
        "name": t.name, "node_names": [n.name for n in t.nodes],
        "gpus_per_node": gpus.pop() if len(gpus) == 1 else [n.gpus for n in t.nodes],
        "gpu": asdict(t.gpu),
        "islands": [[list(g) for g in isl] for isl in t.islands],
        "links": {"island": asdict(t.island_link), "node": asdict(t.node_link), "network": asdict(t.network)},
    }


def topology_from_plan(d, where: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: topology must be a mapping (name, node_names, gpus_per_node, gpu, "
                          "islands, links)")
    try:
        names, gpn = d["node_names"], d["gpus_per_node"]
        if not isinstance(names, list) or not names:
            raise ConfigError("topology.node_names must be a non-empty list")
        counts = gpn if isinstance(gpn, list) else [gpn] * len(names)
        if len(counts) != len(names):
            raise ConfigError(f"topology: {len(counts)} GPU counts for {len(names)} node_names")
        gpu = GpuSpec(**_mapping(d["gpu"], "topology.gpu", GpuSpec))
        nodes = tuple(Node(name=str(n), gpus=c, gpu=gpu) for n, c in zip(names, counts))
        links = _mapping(d["links"], "topology.links")
        made = {k: Link(**_mapping(links.get(k), f"topology.links.{k}", Link)) for k in ("island", "node", "network")}
        islands = d["islands"]
        if not isinstance(islands, list) or not all(
                isinstance(i, list) and all(isinstance(g, list) and len(g) == 2 for g in i) for i in islands):
            raise ConfigError("topology.islands must be lists of [node, gpu] pairs")
        return Topology(name=str(d.get("name", "plan")), nodes=nodes,
                        islands=tuple(tuple((int(n), int(g)) for n, g in i) for i in islands),
                        island_link=made["island"], node_link=made["node"], network=made["network"])
    except KeyError as e:
        raise ConfigError(f"{where}: missing field 'topology.{e.args[0]}'") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: bad topology: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _mapping(v, what: str, cls=None) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{what} must be a mapping")
    if cls is not None:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ConfigError(f"unknown field '{what}.{unknown[0]}'")
    return v


# ---- loading ----------------------------------------------------------------------------

def load_plan(path) -> SavedPlan:
    """A SavedPlan from a plan file; ConfigError (one line, naming the file) for a bad one."""
    p = Path(path)
    where = str(path)
    if not p.is_file():
        raise ConfigError(f"no plan file at {where}" + ("" if not p.exists() else " (it is a directory)"))
    d = read_yaml(p, where, "a plan YAML from `atoll plan --save`")
    if not isinstance(d, dict) or "atoll_plan" not in d:
        raise ConfigError(f"{where}: not an atoll plan (no 'atoll_plan' field); make one with `atoll plan --save`")
    if d["atoll_plan"] != VERSION:
        raise ConfigError(f"{where}: plan format {d['atoll_plan']!r}; this atoll reads format {VERSION}")
    for key in ("model", "layout", "topology", "placement"):
        if key not in d:
            raise ConfigError(f"{where}: missing field '{key}'")
    model = d["model"]
    if not isinstance(model, dict) or not isinstance(model.get("shapes"), dict):
        raise ConfigError(f"{where}: 'model' must hold name and shapes")
    try:
        layout = Layout.parse(str(d["layout"]))
    except AtollError as e:
        raise ConfigError(f"{where}: {e}") from None
    replicas = d.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"{where}: replicas={replicas!r} must be a whole number of at least 1")
    topology = topology_from_plan(d["topology"], where)
    placement = _placement(d["placement"], layout, topology, where)
    preds = d.get("predictions") or {}
    if not isinstance(preds, dict):
        raise ConfigError(f"{where}: 'predictions' must be a mapping")
    deployment = d.get("deployment") or {}
    if deployment:
        check_deployment(deployment, where)
    return SavedPlan(model=str(model.get("name", "model")), shapes=dict(model["shapes"]), layout=layout,
                     replicas=replicas, topology=topology, placement=placement, predictions=preds,
                     workload=d.get("workload") or {}, reasons=tuple(d.get("reasons") or ()), deployment=deployment)


def check_deployment(d, where: str) -> None:
    """A plan's deployment mapping holds only Deployment's fields, each in range (one line)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: 'deployment' must be a mapping")
    known = {f.name for f in fields(Deployment)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{where}: deployment has unknown fields {', '.join(unknown)}")
    try:
        Deployment(**d)
    except (AtollError, TypeError) as e:
        raise ConfigError(f"{where}: deployment: {e}") from None


def _placement(rows, layout: Layout, topology, where: str) -> Placement:
    names = [n.name for n in topology.nodes]
    if not isinstance(rows, list) or len(rows) != layout.world_size:
        n = len(rows) if isinstance(rows, list) else 0
        raise ConfigError(f"{where}: placement lists {n} ranks; layout {layout} has {layout.world_size}")
    slots, island = [], []
    for r, row in enumerate(rows):
        if not isinstance(row, dict) or row.get("rank", r) != r:
            raise ConfigError(f"{where}: placement entry {r} must be {{rank: {r}, node: ..., gpu: ...}}")
        node, gpu = row.get("node"), row.get("gpu")
        if node not in names:
            raise ConfigError(f"{where}: rank {r} is on node {node!r}, which the plan's topology does not have "
                              f"({', '.join(names)})")
        n = names.index(node)
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < topology.nodes[n].gpus:
            raise ConfigError(f"{where}: rank {r} is on GPU {gpu!r} of {node}, which has GPUs "
                              f"0..{topology.nodes[n].gpus - 1}")
        isl = topology.island_of((n, gpu))
        if "island" in row and row["island"] != isl:
            raise ConfigError(f"{where}: rank {r} says island {row['island']!r} but GPU {gpu} of {node} "
                              f"is in island {isl}")
        slots.append((n, gpu))
        island.append(isl)
    try:
        return Placement(layout=layout, slots=tuple(slots), node_names=tuple(names), island=tuple(island))
    except AtollError as e:
        raise ConfigError(f"{where}: {e}") from None
