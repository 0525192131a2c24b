"""nemo-run launch recipes (local and Slurm). Filled by the launch issue."""
