"""What a run shows a person: the per-step line, rollout dumps and their viewer, the papers'
diagnostics, reasoning patterns, trackers and plots. One job per module; nothing here imports
megatron-core."""
