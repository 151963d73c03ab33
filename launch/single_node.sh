#!/usr/bin/env bash
# One machine, NUM_GPUS GPUs, DeepSpeed launcher. Runs from any folder (it cd's to the repo root first, so
# relative paths in the arguments are relative to the repo root). Arguments go to train.py unchanged.
#
#   launch/single_node.sh --model tiny-deepseek-v3 --max-steps 20 --out runs/smoke
#   NUM_GPUS=2 DS_CONFIG=ds_configs/zero3.json launch/single_node.sh --out runs/z3
#
# Env: NUM_GPUS (3), DS_CONFIG (ds_configs/zero2.json), MASTER_PORT (29500; change it to run two jobs at once),
#      TRAIN_SCRIPT (train.py), DRY_RUN=1 prints the command without running it.
#      CUDA_VISIBLE_DEVICES=1,2 (without NUM_GPUS) runs on exactly those GPUs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then source .venv/bin/activate; fi
source launch/env_4090.sh

DS_CONFIG="${DS_CONFIG:-ds_configs/zero2.json}"
if [[ ! -f "$DS_CONFIG" ]]; then
  echo "single_node.sh: DS_CONFIG=$DS_CONFIG not found. Fix: pick one of: $(ls ds_configs/*.json 2>/dev/null | tr '\n' ' ')" >&2
  exit 2
fi
# DeepSpeed drops CUDA_VISIBLE_DEVICES when --num_gpus is given (it would use GPUs 0..N-1): pass it only without one.
gpus=(--num_gpus="${NUM_GPUS:-3}")
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" && -z "${NUM_GPUS:-}" ]]; then gpus=(); fi
cmd=(deepspeed "${gpus[@]}" --master_port="${MASTER_PORT:-29500}"
     "${TRAIN_SCRIPT:-train.py}" --deepspeed_config "$DS_CONFIG" "$@")
echo "+ cd $PWD && $(printf '%q ' "${cmd[@]}")"
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
exec "${cmd[@]}"
