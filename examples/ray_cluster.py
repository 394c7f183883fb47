"""Generate across a Ray cluster: one Ray actor per rank, each TP group inside one node.

On a cluster (the driver may run on the head node without GPUs; each rank reserves one GPU
and sees all of its node's, so the ranks of a node can use NVLink):

    ray start --head --port=6379 --num-gpus=0                 # head node
    ray start --address=HEAD_IP:6379                          # every GPU node
    python examples/ray_cluster.py --address HEAD_IP:6379 --device cuda \
        --model /models/Llama-3.1-70B-Instruct --layout TP8PP2 --prompt "Why is the sea salty?"

On this machine only (Ray listens on 127.0.0.1; CPU ranks, gloo):

    python examples/ray_cluster.py --model DIR --layout TP2PP2 --device cpu --prompt-ids 5,7,9

Each --prompt (text, needs the model's tokenizer.json) or --prompt-ids (token ids) is one
request; results print as JSON lines.
"""

import argparse
import json

from atoll.config import DEVICES
from atoll.engine.sample.sampler import SamplingParams
from atoll.launch.api import LLM, RayLauncher
from atoll.parallel.layout import Layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--layout", default="TP2PP2")
    p.add_argument("--address", default=None, help="Ray cluster address; none starts Ray here")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="cuda: one GPU per rank; auto: that when the cluster has a GPU per rank, else cpu")
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()

    prompts = args.prompt + [[int(t) for t in ids.split(",")] for ids in args.prompt_ids]
    # the ranks are Ray actors kept between calls; a TP group's ranks stay on one node
    launcher = RayLauncher(address=args.address, tp_size=Layout.parse(args.layout).tp)
    with LLM(args.model, layout=args.layout, device=args.device, launcher=launcher) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens))
    for out in outs:
        print(json.dumps(out.to_json()))


if __name__ == "__main__":
    main()
