"""Cloud TPU launch scripts (scripts/tpu/) and TPU run configs (configs/), without a network.

The scripts cannot reach Google Cloud here, so they are checked for syntax and strict mode, and
run under DRY_RUN=1 (common.sh prints each gcloud command line instead of running it) to check
the commands they would run. Every config must load into a RunConfig, and those named after a
TPU slice (`<model>-v5e-16.yaml`) must have a mesh over exactly that many chips that the
capacity planner says fits.
"""

import glob
import os
import re
import shlex
import subprocess

import pytest

from jaxinfer import config as cfg
from jaxinfer.perf import planner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_DIR = os.path.join(REPO, "scripts", "tpu")
SCRIPTS = sorted(glob.glob(os.path.join(TPU_DIR, "**", "*.sh"), recursive=True))
ENTRY_POINTS = sorted(p for p in glob.glob(os.path.join(TPU_DIR, "*.sh"))
                      if not p.endswith("common.sh"))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
# <planner model>-<chip>-<chips>.yaml, e.g. llama-3.1-70b-v5e-16.yaml
SLICE_NAME = re.compile(
    r"^(?P<model>.+?)(-(?P<weights>int8|int4))?-(?P<chip>v5e|v6e)-(?P<chips>\d+)\.yaml$")


def _ids(paths):
    return [os.path.relpath(p, REPO) for p in paths]


def _dry_run(script: str, *args: str, **env: str) -> list[list[str]]:
    """Runs scripts/tpu/<script> under DRY_RUN=1; returns the argv of each gcloud command."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
            "DRY_RUN": "1", "PROJECT": "test-project"}
    proc = subprocess.run(["bash", os.path.join(TPU_DIR, script), *args],
                          env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line[2:]) for line in proc.stdout.splitlines()
            if line.startswith("+ gcloud ")]


def _flag(argv: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")]
    return value


# ----- every script -----------------------------------------------------------------------------
def test_scripts_found():
    names = {os.path.basename(p) for p in ENTRY_POINTS}
    assert {"create.sh", "install.sh", "copy_configs.sh", "run.sh", "collect.sh",
            "delete.sh"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_script_parses_with_bash_n(path):
    proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_script_uses_strict_mode(path):
    with open(path) as f:
        lines = [line.strip() for line in f]
    assert "set -euo pipefail" in lines, f"{path} lacks 'set -euo pipefail'"


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=_ids(ENTRY_POINTS))
def test_entry_point_is_executable_and_documented(path):
    assert os.access(path, os.X_OK), f"chmod +x {path}"
    with open(os.path.join(TPU_DIR, "README.md")) as f:
        assert os.path.basename(path) in f.read(), f"scripts/tpu/README.md never names {path}"


# ----- run.sh: the same command on every worker -------------------------------------------------
@pytest.mark.parametrize("accelerator, multihost", [
    ("v5litepod-8", False), ("v6e-8", False), ("v5litepod-16", True), ("v6e-16", True)])
def test_run_sends_one_command_to_all_workers(accelerator, multihost):
    [argv] = _dry_run("run.sh", "--max_new_tokens=32", ACCELERATOR_TYPE=accelerator,
                      CONFIG="llama-3.1-70b-v5e-16.yaml", RUN_NAME="r1")
    assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    assert "--worker=all" in argv
    command = shlex.split(_flag(argv, "--command"))
    assert any(word.endswith("/bin/jaxinfer-generate") for word in command)
    assert "--config=configs/llama-3.1-70b-v5e-16.yaml" in command
    assert "--output_jsonl=outputs/r1.jsonl" in command
    assert "--max_new_tokens=32" in command
    assert ("--multihost" in command) == multihost


def test_run_multihost_can_be_forced():
    [argv] = _dry_run("run.sh", ACCELERATOR_TYPE="v5litepod-8", MULTIHOST="1")
    assert "--multihost" in shlex.split(_flag(argv, "--command"))


@pytest.mark.parametrize("accelerator, multihost", [("v5litepod-8", False),
                                                     ("v5litepod-16", True)])
def test_serve_starts_the_server_on_all_workers(accelerator, multihost):
    [argv] = _dry_run("serve.sh", "--max_waiting_requests=64", ACCELERATOR_TYPE=accelerator,
                      CONFIG="llama-3.1-70b-v5e-16.yaml", PORT="8100")
    assert "--worker=all" in argv
    command = shlex.split(_flag(argv, "--command"))
    assert any(word.endswith("/bin/jaxinfer-serve") for word in command)
    assert "--config=configs/llama-3.1-70b-v5e-16.yaml" in command
    assert "--port=8100" in command and "--max_waiting_requests=64" in command
    assert ("--multihost" in command) == multihost


# ----- create.sh: docs-accurate gcloud flags ------------------------------------------------------
def test_create_on_demand_uses_the_runtime_for_the_chip():
    [argv] = _dry_run("create.sh", ACCELERATOR_TYPE="v5litepod-8")
    assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert _flag(argv, "--accelerator-type") == "v5litepod-8"
    assert _flag(argv, "--version") == "v2-alpha-tpuv5-lite"
    assert _flag(argv, "--zone") == "us-west4-a"
    assert _flag(argv, "--project") == "test-project"
    [argv] = _dry_run("create.sh", ACCELERATOR_TYPE="v6e-8")
    assert _flag(argv, "--version") == "v2-alpha-tpuv6e"


def test_create_spot_and_best_effort_are_queued_resources():
    [argv] = _dry_run("create.sh", "--spot", ACCELERATOR_TYPE="v5litepod-16", TPU_NAME="t")
    assert argv[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert "--spot" in argv and _flag(argv, "--node-id") == "t"
    assert _flag(argv, "--runtime-version") == "v2-alpha-tpuv5-lite"
    # The best-effort tier exists only in the alpha command (API v2alpha1).
    [argv] = _dry_run("create.sh", "--best-effort", ACCELERATOR_TYPE="v6e-8")
    assert argv[:6] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create"]
    assert "--best-effort" in argv and "--spot" not in argv


def test_create_attaches_the_data_disk_read_only_on_a_slice():
    [argv] = _dry_run("create.sh", ACCELERATOR_TYPE="v5litepod-16", DATA_DISK="llama-70b",
                      ZONE="us-central1-a")
    assert _flag(argv, "--data-disk") == (
        "source=projects/test-project/zones/us-central1-a/disks/llama-70b,mode=read-only")
    [argv] = _dry_run("create.sh", ACCELERATOR_TYPE="v6e-8", DATA_DISK="d")
    assert _flag(argv, "--data-disk").endswith(",mode=read-write")


def test_create_rejects_an_unknown_argument():
    proc = subprocess.run(["bash", os.path.join(TPU_DIR, "create.sh"), "--preemptible"],
                          env={"PATH": os.environ["PATH"], "DRY_RUN": "1", "PROJECT": "p"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "--preemptible" in proc.stderr


def test_install_copies_to_and_runs_on_all_workers():
    commands = _dry_run("install.sh")
    assert commands and all("--worker=all" in argv for argv in commands)
    assert any(argv[4] == "ssh" and "jaxinfer-setup.sh" in _flag(argv, "--command")
               for argv in commands)


# ----- configs ------------------------------------------------------------------------------------
def _load(path: str) -> cfg.RunConfig:
    """What `--config=path` resolves to: a `preset:` key applies that preset first."""
    data, _ = cfg.load_yaml(path)
    run = cfg.RunConfig()
    preset = data.pop("preset", None)
    if preset:
        run = cfg.merge(run, cfg.preset(preset), source=f"preset {preset!r}")
    return cfg.merge(run, data, source=path)


@pytest.mark.parametrize("path", CONFIGS, ids=_ids(CONFIGS))
def test_config_loads_into_a_run_config(path):
    assert isinstance(_load(path), cfg.RunConfig)


SLICE_CONFIGS = [p for p in CONFIGS if SLICE_NAME.match(os.path.basename(p))]


def test_tpu_configs_exist():
    names = {os.path.basename(p) for p in SLICE_CONFIGS}
    assert {"llama-3.1-8b-v5e-8.yaml", "llama-3.1-70b-v5e-16.yaml",
            "llama-3.1-70b-v6e-8.yaml", "qwen3-30b-a3b-v6e-4.yaml", "qwen3-30b-a3b-v5e-8.yaml",
            "qwen3-235b-a22b-int8-v6e-8.yaml", "gpt-oss-120b-v6e-8.yaml",
            "mixtral-8x7b-v5e-8.yaml"} <= names


@pytest.mark.parametrize("path", SLICE_CONFIGS, ids=_ids(SLICE_CONFIGS))
def test_tpu_config_mesh_covers_the_slice_and_fits(path):
    name = SLICE_NAME.match(os.path.basename(path))
    chips = int(name["chips"])
    run = _load(path)
    mesh = re.fullmatch(r"data:(\d+)(,expert:(\d+))?,model:(\d+)", run.mesh or "")
    assert mesh, f"{path}: mesh={run.mesh!r} is not 'data:D,model:M' or 'data:D,expert:E,model:M'"
    data, expert, model = int(mesh[1]), int(mesh[3] or 1), int(mesh[4])
    assert data * expert * model == chips, (
        f"{path}: data {data} x expert {expert} x model {model} != {chips} chips")
    # v5e/v6e hosts have at most 8 chips: a larger slice is several hosts.
    assert run.multihost == (chips > 8)
    assert run.model_path and os.path.isabs(run.model_path), "same absolute path on every host"
    assert run.weight_dtype == name["weights"], "the file name says the weight dtype"
    plan = planner.plan(planner.PlanConfig(
        model=name["model"], chip=name["chip"], num_chips=chips, mesh=run.mesh,
        max_slots=run.engine.max_slots, max_seq_len=run.cache.max_seq_len,
        page_size=run.cache.page_size, weight_dtype=run.weight_dtype or run.dtype or "bfloat16",
        kv_dtype=run.cache.dtype or run.dtype or "bfloat16"))
    assert plan.largest_batch >= run.engine.max_slots
