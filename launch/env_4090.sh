# shellcheck shell=bash
# NCCL / CUDA settings for RTX 4090 boxes (PCIe only, no GPU peer-to-peer, no InfiniBand).
# Source it, don't run it:   source launch/env_4090.sh
# Every value keeps a setting you exported before sourcing, so you can override any of them.
# The launch/*.sh scripts source this file themselves; `python -m deepzero.doctor` shows what is set.

# GeForce RTX 40-series: the driver disables P2P; NCCL must not try it (hangs / wrong sums), it goes through host memory.
export NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"
# No InfiniBand/RoCE here: skip the IB probe so NCCL uses plain TCP sockets between nodes.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
# Multi-node: pin NCCL and gloo to the NIC that reaches the other nodes (`ip -br addr`), or exclude lo/docker with "^lo,docker0".
# export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0
# Keep CUDA's 8 hardware queues so ZeRO's overlap_comm stream runs beside compute (Megatron's =1 would serialize them).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-8}"
# CPU threads per rank = cores / local ranks (NUM_GPUS, default 3): enough for cpu_adam offload, no oversubscription.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / ${NUM_GPUS:-3} > 0 ? $(nproc) / ${NUM_GPUS:-3} : 1 ))}"
# Grow allocations in place instead of fragmenting 24 GB into unusable holes (fewer OOMs with changing seq lengths).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
