"""DFlash drafter training, in layers (docs/ARCHITECTURE.md): `core` <- `model` <- `data` <- `training`
<- `run` and `serve`; the modules at this level are the commands (`python -m dflash_ops.train`, ...)."""
