"""The docs say what the code does: every command line in README.md and docs/ names a console
script or script that exists and only flags it defines, every relative link resolves, the README
stays short, the generated configuration reference is current, and nothing refers to a
design file other than docs/architecture.md.

A command is a `jaxinfer-*` console script, or a `scripts/...` file (run as `python scripts/x.py`
or directly), with the arguments after it up to a shell operator or the end of the line (`\\`
continuations joined), in a fenced code block or an inline code span. Each program's flags come
from its own `--helpfull` (`--help` for an argparse script), one process per program: the CLIs'
absl flags cannot share a process. The processes are forked from one that has imported what
they share (jax, flax, the engine), so each costs a few milliseconds, not a Python start and
those imports (about 2 s apiece). Paths in a command (`scripts/...`, `configs/...`) must exist.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ">", ">>", "<"}


def console_scripts() -> dict[str, str]:
    """`[project.scripts]` of pyproject.toml: console script -> its module."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+):\w+"', section.group(1), re.M))


def code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of every shell line of a fenced block (continuations joined) and of
    every inline code span outside the blocks."""
    out: list[tuple[int, str]] = []
    fenced, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
        else:
            out += [(number, span) for span in re.findall(r"`([^`\n]+)`", line)]
    return out


def tokens(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote in prose
        return text.split()


def program_of(token: str, scripts: dict[str, str]) -> str | None:
    name = token.rsplit("/", 1)[-1]
    if name in scripts or re.fullmatch(r"jaxinfer-[a-z]+", token):  # a typo fails below
        return name
    if token.startswith("scripts/") and token.endswith((".py", ".sh")):
        return token
    return None


@functools.cache
def commands() -> list[tuple[str, str, list[str]]]:
    """(where, program, arguments) of every command in the docs."""
    scripts = console_scripts()
    found = []
    for path in DOCS:
        for number, text in code_lines(path):
            words = tokens(text)
            for i, word in enumerate(words):
                program = program_of(word, scripts)
                if program is None:
                    continue
                args = []
                for arg in words[i + 1:]:
                    if arg in OPERATORS:
                        break
                    args.append(arg)
                found.append((f"{path.relative_to(ROOT)}:{number}", program, args))
    return found


def flags_used(args: list[str]) -> list[str]:
    return [a.lstrip("-").split("=", 1)[0] for a in args
            if a.startswith("-") and len(a) > 1 and not a.lstrip("-")[:1].isdigit()]


# Run as `python -c HELP_LISTER '[[program, module or null], ...]'` in the checkout: prints a
# JSON object, program -> what `program --helpfull` (`--help`: argparse) wrote to stdout, or the
# traceback of its failure. Each program runs in a child forked after the shared imports, as
# its own `__main__` (a console script: its module's `run()`), with stdout on a temporary file.
HELP_LISTER = """
import json, os, runpy, sys, tempfile, traceback
import absl.app, flax.nnx, jax, jax.numpy, numpy, optax, orbax.checkpoint
import jaxinfer.engine.llm
out = {}
for program, module in json.loads(sys.argv[1]):
    f = tempfile.TemporaryFile()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(f.fileno(), 1)
        try:
            if module:
                sys.argv = [program, '--helpfull']
                __import__(module, fromlist=['run']).run()
            else:
                text = open(program).read()
                sys.argv = [program, '--help' if 'argparse' in text else '--helpfull']
                sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
                runpy.run_path(program, run_name='__main__')
        except SystemExit:
            pass
        except BaseException:
            traceback.print_exc(file=sys.stdout)
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.waitpid(pid, 0)
    f.seek(0)
    out[program] = f.read().decode()
print(json.dumps(out))
"""


@functools.cache
def help_texts() -> dict[str, str]:
    """The help output (`HELP_LISTER`) of every program a documented command passes flags to,
    a launcher's (`x.sh`) read from the script of its name."""
    scripts = console_scripts()
    programs = sorted({p[:-3] + ".py" if p.endswith(".sh") else p
                       for _, p, args in commands() if flags_used(args)})
    listed = [(p, scripts.get(p)) for p in programs
              if p in scripts or (ROOT / p).is_file()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", HELP_LISTER, json.dumps(listed)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@functools.cache
def defined_flags(program: str) -> frozenset[str]:
    """The flags `program` accepts, from its own help output."""
    help_text = help_texts().get(program, "")
    names = set()
    for line in help_text.splitlines():
        if line.lstrip().startswith("-"):
            for no, name in re.findall(r"(?<![\w-])--?(\[no\])?([A-Za-z][\w-]*)", line):
                names |= {name, f"no{name}"} if no else {name}
    assert len(names) > 3, f"{program}: no flags found in its help:\n{help_text[:2000]}"
    return frozenset(names)


def _programs() -> list[str]:
    return sorted({program for _, program, _ in commands()})


def test_the_docs_have_commands_to_check():
    programs = _programs()
    assert {"jaxinfer-generate", "jaxinfer-serve", "jaxinfer-tts", "jaxinfer-plan"} <= set(programs)
    assert sum(p.startswith("scripts/") for p in programs) >= 5


@pytest.mark.parametrize("program", _programs())
def test_every_command_uses_flags_its_program_defines(program):
    scripts = console_scripts()
    if program.startswith("jaxinfer-"):
        assert program in scripts, f"{program} is not a console script: {sorted(scripts)}"
    else:
        assert (ROOT / program).is_file(), f"{program} does not exist"
    uses = [(where, flag) for where, p, args in commands() if p == program
            for flag in flags_used(args)]
    if not uses:
        return
    if program.endswith(".sh"):  # a launcher passes its flags to the script of its name
        target = program[:-3] + ".py"
        assert (ROOT / target).is_file() and target in (ROOT / program).read_text(), (
            f"{program} takes no flags: {uses}")
        program = target
    known = defined_flags(program)
    bad = [f"{where}: --{flag} (closest: {difflib.get_close_matches(flag, known, n=2)})"
           for where, flag in uses if flag not in known]
    assert not bad, f"{program} has no such flag:\n" + "\n".join(bad)


def test_paths_in_commands_exist():
    missing = []
    for where, _, args in commands():
        for arg in args:
            value = arg.split("=", 1)[-1]
            if value.startswith(("scripts/", "configs/")) and "$" not in value:
                if not (ROOT / value).exists():
                    missing.append(f"{where}: {value}")
    assert not missing, "\n".join(missing)


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    broken = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file) if file else path
                if not dest.exists() or (anchor and dest.suffix == ".md"
                                         and anchor not in anchors(dest)):
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "\n".join(broken)


TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".json", ".yaml", ".toml"}


def project_text_files() -> list[pathlib.Path]:
    """README.md and every text file under jaxinfer/, tests/, scripts/ and docs/."""
    files = [ROOT / "README.md"]
    for top in ("jaxinfer", "tests", "scripts", "docs"):
        files += [f for f in sorted((ROOT / top).rglob("*"))
                  if f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts]
    return files


# The name of a design file that lives outside the repository (spelled in two parts, so this
# check does not cite it itself).
OUTSIDE_DESIGN_FILE = "DESIGN" + ".md"


def test_no_reference_to_a_design_file_outside_the_repository():
    """The design document is docs/architecture.md; a reference to the outside design file
    points nowhere."""
    files = [f for f in project_text_files() if f != pathlib.Path(__file__).resolve()]
    assert ROOT / "jaxinfer" / "config.py" in files and ROOT / "docs" / "architecture.md" in files
    stale = [f"{f.relative_to(ROOT)}:{number}"
             for f in files
             for number, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE_DESIGN_FILE in line]
    assert not stale, "refer to docs/architecture.md's decisions instead:\n" + "\n".join(stale)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the guide is docs/"


def test_configuration_reference_is_current(tmp_path):
    out = tmp_path / "configuration.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "scripts/gen_config_reference.py", f"--output={out}"],
                   check=True, capture_output=True, env=env, cwd=ROOT, timeout=600)
    committed = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert out.read_text() == committed, (
        "docs/reference/configuration.md is stale: run python scripts/gen_config_reference.py")


def test_a_wrong_flag_is_caught():
    """The checker itself: a made-up flag of a real CLI is not among its flags."""
    assert "max_new_tokens" in defined_flags("jaxinfer-generate")
    assert "nowarmup" in defined_flags("jaxinfer-generate")
    assert "max_new_tokenz" not in defined_flags("jaxinfer-generate")
    assert flags_used(tokens("jaxinfer-generate --x=1 -v=1 --no_y 'a b' -3")[1:]) == [
        "x", "v", "no_y"]
