#!/bin/bash
# Launch train.py on N processes of this node with torchrun: ./distributed_train.sh N [train.py args...]
# Multi-node: run it on each node with torchrun's own variables/flags (PET_NNODES, PET_NODE_RANK,
# PET_MASTER_ADDR, ...), or launch train.py under SLURM directly (srun python train.py ...).
NUM_PROC=$1
shift
exec torchrun --nproc_per_node="$NUM_PROC" "$(dirname "$0")/train.py" "$@"
