"""What the drafter learns from: the examples and their batches, the frozen target and its features,
regeneration with the target, feature capture and the feature cache, the demo's tiny assets.
Imports `dflash_ops.core` and `dflash_ops.model`."""
