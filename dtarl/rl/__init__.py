"""RL: advantages, tasks, rewards, the episode builder, optimiser and the training loop."""
