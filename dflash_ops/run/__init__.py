"""The run as a whole: the entry point's work (`python -m dflash_ops.train`), the torchrun launcher, the
pipeline's target and drafter ranks, the transport between them, status.json, the feature cache's
feed. Imports the layers below; nothing imports it but the commands."""
