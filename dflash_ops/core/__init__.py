"""The base every layer stands on: the config and its sections, devices, safe paths, the runtime's
events and stop signal, the mask token, the target layer ids, the stop timeouts, file helpers.
Imports nothing of the other layers."""
