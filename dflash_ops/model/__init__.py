"""The drafter: its layers and attention, the block loss and its chunked head, the packed hidden
states, acceptance counting, and the modeling file shipped with exports. Knows nothing of processes,
devices or checkpoints; imports only `dflash_ops.core`."""
