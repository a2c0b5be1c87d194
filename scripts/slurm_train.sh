#!/bin/bash
# Multi-node training under SLURM: one task (process) per GPU, JAX's SLURM convention.
#
#   sbatch --nodes=4 scripts/slurm_train.sh --preset=gpt2 --mesh=data:4,fsdp:8 --batch_size=32 --gradient_accumulation_steps=15
#
# Every argument is passed on to train.py. `--distributed` makes each task call
# jax.distributed.initialize(), which reads the coordinator (the first node of the step, port derived
# from the job id), the number of processes, this task's rank (SLURM_NTASKS, SLURM_PROCID) and its
# GPU (SLURM_LOCALID) from SLURM's environment, so no --coordinator_address is needed.
# The product of the --mesh sizes must equal the job's total number of GPUs (nodes x 8); leave
# --mesh out for pure data parallelism over all of them; --batch_size (the global batch) must be
# divisible by data x fsdp x expert.
# --out_dir must be on a filesystem every node sees: all processes write the checkpoint together.
#
#SBATCH --job-name=gpt
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

# Give up with a clear error if some node has not joined within 10 minutes (default 300 s).
export GPT_DISTRIBUTED_TIMEOUT="${GPT_DISTRIBUTED_TIMEOUT:-600}"
# Each task picks GPU number SLURM_LOCALID itself, so do not bind GPUs per task (no --gpus-per-task).
PYTHON="${PYTHON:-python}"
srun --kill-on-bad-exit=1 "$PYTHON" train.py --distributed "$@"
