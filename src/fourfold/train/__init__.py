"""Training on the runtime: the trainer loop, evaluation, generation, run records, the torchrun and SLURM launchers."""
