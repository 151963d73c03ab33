#!/usr/bin/env bash
# Several machines, DeepSpeed launcher. Arguments go to train.py unchanged (paths relative to the repo root).
#
# 1) ssh mode (default): run ONCE, on the first node. DeepSpeed reads HOSTFILE and starts one launcher per node
#    with pdsh over passwordless ssh. Every node needs the repo and the venv at the same path.
#      cp launch/hostfile.example launch/hostfile      # one "host slots=GPUS" line per node; first line = master
#      launch/multi_node.sh --model deepseek-coder-1.3b --out runs/mn
#
# 2) --no_ssh mode: run on EVERY node (no ssh between nodes: containers, cloud VMs, a job scheduler).
#    Each node starts its own launcher with its own NODE_RANK; all must agree on MASTER_ADDR and NNODES:
#      node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multi_node.sh --no_ssh --out runs/mn
#      node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/multi_node.sh --no_ssh --out runs/mn
#    DeepSpeed sizes the job from a hostfile even here: HOSTFILE if it exists, else one written from
#    NNODES x NUM_GPUS (node names do not matter in this mode, only the line order).
#
# Env: HOSTFILE (launch/hostfile), MASTER_ADDR (ssh mode: first host of HOSTFILE; --no_ssh: required),
#      MASTER_PORT (29500), NUM_GPUS (GPUs per node; ssh mode default: the hostfile slots; --no_ssh default: 3),
#      NNODES, NODE_RANK (--no_ssh), DS_CONFIG (ds_configs/zero2.json), TRAIN_SCRIPT (train.py),
#      DRY_RUN=1 prints the command without running it.
# Nodes with several NICs: export NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME first (see launch/env_4090.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then source .venv/bin/activate; fi
source launch/env_4090.sh

die() { echo "multi_node.sh: $1. Fix: $2" >&2; exit 2; }
NO_SSH=0
if [[ "${1:-}" == "--no_ssh" ]]; then NO_SSH=1; shift; fi
HOSTFILE="${HOSTFILE:-launch/hostfile}"
DS_CONFIG="${DS_CONFIG:-ds_configs/zero2.json}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-train.py}"
[[ -f "$DS_CONFIG" ]] || die "DS_CONFIG=$DS_CONFIG not found" "pick one of: $(ls ds_configs/*.json 2>/dev/null | tr '\n' ' ')"
tmp_files=()
trap 'rm -f "${tmp_files[@]}"' EXIT

if [[ $NO_SSH == 1 ]]; then
  [[ -n "${NODE_RANK:-}" ]] || die "--no_ssh needs NODE_RANK" "export NODE_RANK=0 on the master, 1.. on the others"
  [[ -n "${MASTER_ADDR:-}" ]] || die "--no_ssh needs MASTER_ADDR" "export MASTER_ADDR=<IP of node rank 0> on every node"
  if [[ ! -f "$HOSTFILE" ]]; then
    [[ -n "${NNODES:-}" ]] || die "--no_ssh needs NNODES (or a HOSTFILE)" "export NNODES=<number of nodes> on every node"
    HOSTFILE="$(mktemp "${TMPDIR:-/tmp}/deepzero-hostfile.XXXXXX")"
    tmp_files+=("$HOSTFILE")
    for ((i = 0; i < NNODES; i++)); do echo "node$i slots=${NUM_GPUS:-3}"; done > "$HOSTFILE"
  fi
  launcher=(--no_ssh --node_rank="$NODE_RANK")
else
  [[ -f "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE not found" "cp launch/hostfile.example launch/hostfile and list your nodes"
  MASTER_ADDR="${MASTER_ADDR:-$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")}"
  [[ -n "$MASTER_ADDR" ]] || die "HOSTFILE=$HOSTFILE lists no host" "add one 'host slots=GPUS' line per node"
  # pdsh forwards only NCCL_*/PYTHON* variables to the other nodes: pass the rest of env_4090.sh through an env file
  # (DS_ENV_FILE replaces ~/.deepspeed_env and ./.deepspeed_env, so their lines are copied in too).
  DS_ENV_FILE="$(mktemp "${TMPDIR:-/tmp}/deepzero-ds-env.XXXXXX")"
  tmp_files+=("$DS_ENV_FILE")
  for var in CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS PYTORCH_CUDA_ALLOC_CONF GLOO_SOCKET_IFNAME; do
    if [[ -n "${!var:-}" ]]; then echo "$var=${!var}"; fi
  done > "$DS_ENV_FILE"
  cat ~/.deepspeed_env ./.deepspeed_env 2>/dev/null >> "$DS_ENV_FILE" || true
  export DS_ENV_FILE
  launcher=(--launcher=pdsh)
fi

cmd=(deepspeed --hostfile="$HOSTFILE" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}"
     "${launcher[@]}" ${NUM_GPUS:+--num_gpus="$NUM_GPUS"}
     "$TRAIN_SCRIPT" --deepspeed_config "$DS_CONFIG" "$@")
echo "+ cd $PWD && $(printf '%q ' "${cmd[@]}")"
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
if [[ $NO_SSH == 0 ]] && ! command -v pdsh > /dev/null; then
  die "pdsh is not installed" "apt install pdsh (on the first node), or run every node with --no_ssh"
fi
"${cmd[@]}"
