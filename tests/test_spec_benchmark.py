"""Smoke test of scripts/spec_benchmark.py: a one-layer model with SmolLM2's tokenizer and a
random EAGLE-3 head, the eagle drafter, n-gram chains and an n-gram draft tree, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxinfer.checkpoint.eagle import save_draft_head
from jaxinfer.checkpoint.loading import load_model
from jaxinfer.config import RunConfig
from jaxinfer.model.eagle import HeadConfig
from jaxinfer.train import draft_head as train
from tests.helpers import tiny_smollm_dir

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "spec_benchmark.py")


def _bench(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
    env.pop("XLA_FLAGS", None)  # one device, as a user runs it
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=900, cwd=REPO_ROOT, env=env)


@pytest.mark.slow  # a script end to end in its own process (1.5 min of CPU)
def test_eagle_and_tree_drafts_in_the_benchmark(tmp_path):
    model_dir = tiny_smollm_dir(str(tmp_path / "model"))
    model, ckpt = load_model(RunConfig(model_path=model_dir, dtype="float32"))
    config = HeadConfig.for_target(model.config, kind="eagle3", draft_vocab_size=512)
    canonical = {k: ckpt.params[k] for k in ("embed", "final_norm")}
    save_draft_head(str(tmp_path / "head"), config, train.init_head_params(
        config, canonical, d2t=list(range(512)), seed=0))
    common = [f"--model_path={model_dir}", "--workloads=copy,chat", "--batch_sizes=2",
              "--max_new_tokens=6"]
    proc = _bench(common + ["--methods=eagle,ngram", "--num_spec=2", "--spec_tree=2,1",
                            f"--draft_head_path={tmp_path / 'head'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]
    runs = {(r["workload"], r["method"], r["R"], r["tree"]) for r in rows}
    assert runs == {(w, m, r, t) for w in ("copy", "chat") for m, r, t in (
        ("none", 0, None), ("eagle", 2, None), ("ngram", 2, None), ("ngram", 0, "2,1"))}
    for r in rows:
        assert r["identical"] and r["decode_tok_s"] > 0 and r["tokens_per_row"] >= 1, r
    assert any(r["method"] == "eagle" and r["acceptance"] is not None for r in rows)
    assert "eagle" in proc.stdout and "2,1" in proc.stdout  # the table
    bad = _bench(common + ["--methods=eagle"])
    assert bad.returncode != 0 and "--methods=eagle needs --draft_head_path" in bad.stderr
    bad = _bench(common + ["--methods=self", "--spec_tree=2,1"])
    assert bad.returncode != 0 and "--spec_tree needs a drafter that drafts trees" in bad.stderr
