"""Writes docs/reference/configuration.md from the code: the config dataclasses
(`jaxinfer.config`), the one flag table that maps flags onto them (`jaxinfer.cli.flags`), the
presets, and each console script's own flags (read from `<cli> --helpxml`, one process per CLI:
their flag sets cannot share a process). Nothing in the page is written by hand, so it cannot
drift from the code; `tests/test_docs.py` regenerates it and fails if the committed page differs.

  python scripts/gen_config_reference.py            # rewrites docs/reference/configuration.md
  python scripts/gen_config_reference.py --output=/tmp/configuration.md
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import typing
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from absl import app, flags  # noqa: E402

from jaxinfer import config as cfg  # noqa: E402
from jaxinfer.cli import flags as jflags  # noqa: E402

flags.DEFINE_string("output", os.path.join(REPO, "docs", "reference", "configuration.md"),
                    "Where to write the page.")

SECTIONS = (("", "Model, weights and devices"), ("cache", "KV cache (`cache:`)"),
            ("engine", "Engine (`engine:`)"), ("sampling", "Sampling (`sampling:`)"))


def console_scripts() -> dict[str, str]:
    """`[project.scripts]` of pyproject.toml: console script -> its module."""
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+):\w+"', section.group(1), re.M))


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def shown(value: object) -> str:
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def config_tables() -> list[str]:
    """One table per RunConfig section: YAML key, flag, type, default, meaning."""
    rows = {path: (name, kind, help_) for name, kind, path, help_ in jflags.FLAG_TABLE}
    defaults = cfg.RunConfig()
    out = []
    for section, title in SECTIONS:
        owner = type(getattr(defaults, section)) if section else cfg.RunConfig
        obj = getattr(defaults, section) if section else defaults
        out += [f"### {title}", "", "| YAML key | flag | type | default | meaning |",
                "| --- | --- | --- | --- | --- |"]
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a section of its own
            path = f"{section}.{f.name}" if section else f.name
            name, kind, help_ = rows[path]  # every field has a flag (tests/test_config.py)
            help_ = re.sub(r" Default: .*\.$", "", help_)
            if kind.startswith("enum:"):
                help_ += f" One of: {kind[5:].replace(',', ', ')}."
            out.append(f"| `{path}` | `--{name}` | {cell(cfg.describe_type(hints[f.name]))} | "
                       f"{cell(shown(getattr(obj, f.name)))} | {cell(help_)} |")
        out.append("")
    return out


def model_table() -> list[str]:
    """ModelConfig and RopeConfig: read from the checkpoint, not set by flags."""
    out = []
    for cls in (cfg.ModelConfig, cfg.RopeConfig):
        hints = typing.get_type_hints(cls)
        out += [f"### `{cls.__name__}`", "", "```", inspect.cleandoc(cls.__doc__), "```", "",
                "| field | type | default |", "| --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = shown(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = f"`{type(f.default_factory()).__name__}()`"
            else:
                default = "required"
            out.append(f"| `{f.name}` | {cell(cfg.describe_type(hints[f.name]))} | "
                       f"{cell(default)} |")
        out.append("")
    return out


def cli_flags(script: str, module: str) -> list[dict[str, str]]:
    """The flags `script` defines beside the config table, from its --helpxml."""
    code = f"import sys; sys.argv = [{script!r}, '--helpxml']; import {module} as m; m.run()"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    xml = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=REPO).stdout
    table = {name for name, *_ in jflags.FLAG_TABLE}
    home = os.path.expanduser("~")
    found = []
    for flag in ET.fromstring(xml).iter("flag"):
        get = {child.tag: (child.text or "") for child in flag}
        if get["file"] not in (module, "jaxinfer.cli.flags") or (
                get["file"] == "jaxinfer.cli.flags" and get["name"] in table):
            continue  # absl's own, or the run configuration's (listed above)
        get["default"] = get["default"].replace(home, "~")
        found.append(get)
    if not found:
        raise RuntimeError(f"{script} --helpxml listed no flags of its own:\n{xml[:2000]}")
    return sorted(found, key=lambda g: g["name"])


def cli_tables() -> list[str]:
    out = []
    for script, module in console_scripts().items():
        out += [f"### `{script}`", "", "| flag | type | default | meaning |",
                "| --- | --- | --- | --- |"]
        for g in cli_flags(script, module):
            default = None if g["default"] in ("", "None") else g["default"]
            out.append(f"| `--{g['name']}` | {g['type']} | {cell(shown(default))} "
                       f"| {cell(g['meaning'])} |")
        out.append("")
    return out


def presets() -> list[str]:
    import yaml

    out = ["`--preset=NAME` (or `preset: NAME` in YAML) applies these overrides before the YAML "
           "file and the flags:", ""]
    for name, values in cfg.PRESETS.items():
        out += [f"`{name}`:", "", "```yaml", yaml.safe_dump(values, sort_keys=False).strip(),
                "```", ""]
    return out


def page() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_reference.py from jaxinfer/config.py and",
        "     jaxinfer/cli/; do not edit by hand (tests/test_docs.py checks it is current). -->",
        "",
        "A run is one `RunConfig`. Each field can be set, lowest precedence first, by its",
        "dataclass default, a preset (`--preset`), a YAML file (`--config=configs/x.yaml`, the",
        "YAML key below) and a flag. `jaxinfer-generate`, `jaxinfer-serve` and `jaxinfer-tts`",
        "take every flag of this section; `--print_config` shows the resolved config. A bad",
        "value stops the run with one line naming the value, where it came from and what is",
        "valid.",
        "",
        "## Run configuration",
        "",
        *config_tables(),
        "## Presets",
        "",
        *presets(),
        "## Each command's own flags",
        "",
        "Besides the run configuration above (which `jaxinfer-plan` does not take: its flags",
        "are all its own).",
        "",
        *cli_tables(),
        "## Model configuration",
        "",
        "Read from the checkpoint (GGUF metadata or config.json) by its family",
        "(`jaxinfer/families/`); listed for reference and for adding an architecture.",
        "",
        *model_table(),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    text = page()
    os.makedirs(os.path.dirname(os.path.abspath(flags.FLAGS.output)), exist_ok=True)
    with open(flags.FLAGS.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {flags.FLAGS.output} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    app.run(main)
