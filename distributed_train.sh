#!/bin/bash
# Launch train.py on N processes of this node with torchrun: ./distributed_train.sh N [train.py args...]
# Multi-node: run it on each node with torchrun's own variables/flags (PET_NNODES, PET_NODE_RANK,
# PET_MASTER_ADDR, ...), or launch train.py under SLURM directly (srun python train.py ...).
# With no rendezvous named in those variables the run is one node: --standalone gives it a free port of its own,
# so two runs on one machine (or a run beside a test suite) never meet on torchrun's fixed default port 29500.
NUM_PROC=$1
shift
STANDALONE=--standalone
for name in PET_NNODES PET_NODE_RANK PET_MASTER_ADDR PET_MASTER_PORT PET_RDZV_BACKEND PET_RDZV_ENDPOINT PET_STANDALONE; do
  [ -n "${!name:-}" ] && STANDALONE=
done
exec torchrun $STANDALONE --nproc_per_node="$NUM_PROC" "$(dirname "$0")/train.py" "$@"
