#!/usr/bin/env bash
# atoll generate on two nodes with torchrun: run this once on each node.
#
#   node 0:  bash examples/torchrun_two_nodes.sh 0 NODE0_IP /models/Llama-3.1-70B-Instruct TP8PP2 prompts.jsonl
#   node 1:  bash examples/torchrun_two_nodes.sh 1 NODE0_IP /models/Llama-3.1-70B-Instruct TP8PP2 prompts.jsonl
#
# Tried on one machine as two "nodes" of 2 CPU ranks each (in two shells):
#   GPUS_PER_NODE=2 IFACE=lo bash examples/torchrun_two_nodes.sh 0 127.0.0.1 DIR TP2PP2 prompts.jsonl
#   GPUS_PER_NODE=2 IFACE=lo bash examples/torchrun_two_nodes.sh 1 127.0.0.1 DIR TP2PP2 prompts.jsonl
#
# Ranks are node-major (node 0 holds ranks 0..7), so with TP8PP2 each TP group is one node and
# the pipeline crosses nodes. Rank 0 (on node 0) writes the output file.
set -euo pipefail
NODE_RANK=$1 MASTER_ADDR=$2 MODEL=$3 LAYOUT=$4 PROMPTS=$5
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# name the interface the nodes reach each other on, so no library guesses it (IFACE=ib0, eth0...)
if [ -n "${IFACE:-}" ]; then
  export GLOO_SOCKET_IFNAME=$IFACE NCCL_SOCKET_IFNAME=$IFACE
fi
exec torchrun --nnodes=2 --node-rank="$NODE_RANK" --nproc-per-node="$GPUS_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="${MASTER_PORT:-29500}" \
  -m atoll generate --model "$MODEL" --layout "$LAYOUT" --prompts "$PROMPTS" \
  --output "${OUTPUT:-atoll-out.jsonl}"
