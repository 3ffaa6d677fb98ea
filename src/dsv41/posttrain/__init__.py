"""Post-training at small scale: tasks, SFT, GRPO with the effort-length reward, async rollouts, OPD, merging."""
