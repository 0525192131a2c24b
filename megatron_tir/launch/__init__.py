"""tir-launch: nemo-run launchers for this machine (LocalExecutor) and Slurm clusters.

``cli`` is the ``tir-launch`` command; ``cluster`` reads the cluster file; ``layout`` is the
one contact with the training config; ``slurm`` and ``local`` build the nemo-run
experiments; ``agent`` supervises the processes of one node inside a launched run.
"""
