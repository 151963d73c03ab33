#!/usr/bin/env bash
# torchrun instead of the DeepSpeed launcher (train.py calls deepspeed.init_distributed(), which reads the
# RANK / WORLD_SIZE / MASTER_ADDR variables torchrun sets). Run once per node. Arguments go to train.py.
#
#   launch/torchrun.sh --model tiny-deepseek-v3 --max-steps 20                       # one node, 3 GPUs
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/torchrun.sh --out runs/mn       # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/torchrun.sh --out runs/mn       # on node 1
#
# Rendezvous: RDZV_BACKEND=static (default) uses MASTER_ADDR:MASTER_PORT and NODE_RANK as given.
#             RDZV_BACKEND=c10d is elastic: nodes join at MASTER_ADDR:MASTER_PORT under RDZV_ID and get their
#             rank in order of arrival (NODE_RANK is ignored); NNODES may be a range such as 1:4.
# Env: NUM_GPUS (processes per node: 3, or one per CUDA_VISIBLE_DEVICES entry), NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
#      RDZV_BACKEND (static), RDZV_ID (deepzero), DS_CONFIG (ds_configs/zero2.json), TRAIN_SCRIPT (train.py),
#      DRY_RUN=1 prints the command without running it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then source .venv/bin/activate; fi
source launch/env_4090.sh

DS_CONFIG="${DS_CONFIG:-ds_configs/zero2.json}"
if [[ ! -f "$DS_CONFIG" ]]; then
  echo "torchrun.sh: DS_CONFIG=$DS_CONFIG not found. Fix: pick one of: $(ls ds_configs/*.json 2>/dev/null | tr '\n' ' ')" >&2
  exit 2
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" && -z "${NUM_GPUS:-}" ]]; then  # one process per visible GPU
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  NUM_GPUS="${#visible[@]}"
fi
cmd=(torchrun --nproc_per_node="${NUM_GPUS:-3}" --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}"
     --rdzv_backend="${RDZV_BACKEND:-static}" --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${RDZV_ID:-deepzero}"
     "${TRAIN_SCRIPT:-train.py}" --deepspeed_config "$DS_CONFIG" "$@")
echo "+ cd $PWD && $(printf '%q ' "${cmd[@]}")"
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
exec "${cmd[@]}"
