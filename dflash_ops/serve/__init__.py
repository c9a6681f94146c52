"""What leaves the trainer: the export for serving engines, the evaluation against the target, the
baseline proposers. Imports the layers below `run`; nothing imports it but the commands."""
