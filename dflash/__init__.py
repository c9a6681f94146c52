"""DFlash drafter training: config, target capture, packed hidden states, drafter, training loop."""
