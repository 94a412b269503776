#!/usr/bin/env bash
# Start torchrun on every node of a Slurm allocation, rendezvous on the first node.
#   srun --ntasks-per-node=1 launch/torchrun_slurm.sh -m spmdrl.train --config configs/grpo.toml [overrides]
# One task per node; torchrun starts GPUS_PER_NODE ranks on each (default: the GPUs the task sees, so request
# them per node, not per task). Every rank of a node sees the same GPUs and drives GPU <LOCAL_RANK>.
# Multi-NIC nodes: export GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (the interface the nodes reach each other on)
# before srun; srun passes the environment on (docs/cluster.md).
# spmdrl.process.launcher is torchrun (its arguments, its agent in this process) with one-line errors, and it passes
# Slurm's early-warning SIGUSR1 (sbatch --signal=USR1@N) on to the ranks, which save at the next step boundary
# and exit (docs/reliability.md); plain torchrun's agent would die of it.
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run this under srun inside a Slurm allocation}"
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
exec python -P -m spmdrl.process.launcher \
  --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-spmdrl}" \
  "$@"
