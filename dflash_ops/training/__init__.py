"""One process's training: the trainer (loss, optimizer, schedule), one run's loop, checkpoints,
telemetry and plots, the held-out evaluation. Imports `core`, `model` and `data`."""
