"""Problems with checkable answers: built-in generated tasks and JSONL files.

The built-in tasks are sized for a 135M-parameter chat model (SmolLM2-135M-Instruct): easy enough
that it sometimes succeeds, so test-time scaling has something to improve. Each is generated from
a seed by a private `random.Random(seed)` (never the global generator), so a seed names a fixed
problem set on every machine and Python version that keeps `random`'s documented algorithms.

JSONL format, one object per line (blank lines are skipped):

    {"prompt": "What is 2 + 3?", "answer": "5", "id": "q1", "extractor": "number"}

"id" defaults to "<file stem>-<line number>", "extractor" to "number" and "answer_format" to
"text"; a numeric "answer" is read as its text (5 -> "5"). `save_jsonl` writes the same format,
so a problem set round-trips.

Answer formats (`with_answer_format`): "text" asks for a "Final answer: ..." line and the
problem's extractor finds the answer in free text; "json" asks for a JSON object
`{"answer": ...}` and the answer is parsed from it (`answers.extract_json_answer`), nothing
guessed; "schema" is "json" with the object enforced by the engine (`answer_schema`, a
`SamplingConfig.json_schema`), so every complete reply parses; "reasoning_schema" enforces
`{"reasoning": "...", "answer": ...}`, room to think (a bounded string) before the answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from pathlib import Path

from jaxinfer.tts.answers import (
    EXTRACTORS,
    extract_json_answer,
    get_extractor,
    normalize_reference,
)

_FINAL_NUMBER = "End your reply with 'Final answer: <number>'."
_FINAL_WORD = "End your reply with 'Final answer: <answer>'."
_FINAL_LETTER = "End your reply with 'Final answer: <letter>'."


ANSWER_FORMATS = ("text", "json", "schema", "reasoning_schema")
SCHEMA_FORMATS = ("schema", "reasoning_schema")  # enforced by the engine (`answer_schema`)
# "reasoning" at most, so its tokens are bounded too; SmolLM2 can still spend over 96 tokens on
# 256 characters (docs/benchmarks.md), so give such replies a max_new_tokens above that.
_REASONING_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem. answer: the reference answer as text; extractor: a name in EXTRACTORS;
    answer_format: how a reply states its answer, one of ANSWER_FORMATS (module doc)."""

    id: str
    prompt: str
    answer: str
    extractor: str = "number"
    answer_format: str = "text"

    def __post_init__(self):
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format={self.answer_format!r}; valid: "
                             f"{', '.join(ANSWER_FORMATS)}")


def answer_of(problem: Problem, text: str) -> str | None:
    """A completion's answer to `problem`, normalized by its extractor, or None if it has none:
    found in free text ("text") or parsed from a JSON reply ("json", "schema")."""
    if problem.answer_format == "text":
        return get_extractor(problem.extractor)(text)
    return extract_json_answer(text, problem.extractor)


def is_correct(problem: Problem, answer: str | None) -> bool:
    """Whether an extracted answer (`answer_of`) is the problem's reference answer."""
    return answer is not None and answer == normalize_reference(problem.answer, problem.extractor)


def verify(problem: Problem, text: str) -> bool:
    """Whether a completion's extracted answer equals the problem's (both normalized)."""
    return is_correct(problem, answer_of(problem, text))


# -- arithmetic --------------------------------------------------------------------------------

_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Leo", "Zoe")
_OBJECTS = (
    ("apple", "apples"), ("book", "books"), ("pencil", "pencils"), ("cookie", "cookies"),
    ("marble", "marbles"), ("ball", "balls"), ("card", "cards"), ("sticker", "stickers"),
)  # fmt: skip


def _count(n: int, obj: tuple[str, str]) -> str:
    return f"{n} {obj[0] if n == 1 else obj[1]}"


def _arithmetic(rng: random.Random, level: int) -> tuple[str, int]:
    """One word problem -> (question, answer).

    level 1: one + or - of numbers < 10; 2: + then - of numbers < 20; 3: a * b (+ c).
    """
    name, other = rng.sample(_NAMES, 2)
    obj = rng.choice(_OBJECTS)
    if level == 1:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            q = f"{name} has {_count(a, obj)} and buys {b} more."
            return f"{q} How many {obj[1]} does {name} have now?", a + b
        a, b = max(a, b), min(a, b)
        q = f"{name} has {_count(a, obj)} and gives {b} to {other}."
        return f"{q} How many {obj[1]} does {name} have now?", a - b
    if level == 2:
        a, b = rng.randint(2, 19), rng.randint(1, 19)
        c = rng.randint(1, min(19, a + b - 1))
        q = f"{name} has {_count(a, obj)}. {name} buys {b} more and then gives {c} to {other}."
        return f"{q} How many {obj[1]} does {name} have now?", a + b - c
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    q = f"{name} has {a} boxes with {_count(b, obj)} in each box."
    extra = rng.randint(1, 9) if rng.random() < 0.5 else 0
    if extra:
        q += f" {name} also has {_count(extra, obj)} outside the boxes."
    return f"{q} How many {obj[1]} does {name} have in total?", a * b + extra


def arithmetic_tasks(num: int, seed: int = 0, level: int = 1) -> list[Problem]:
    """`num` arithmetic word problems; answers are non-negative integers, extractor "number"."""
    rng = random.Random(seed)
    problems = []
    for i in range(num):
        question, answer = _arithmetic(rng, level)
        problems.append(
            Problem(f"arithmetic-L{level}-s{seed}-{i}", f"{question}\n{_FINAL_NUMBER}", str(answer))
        )
    return problems


# -- string ------------------------------------------------------------------------------------

WORDS = (
    "apple", "banana", "cat", "dog", "house", "tree", "river", "garden", "yellow", "window",
    "pencil", "orange", "table", "music", "bread", "cloud", "tiger", "lemon", "rabbit",
    "paper", "summer", "chair", "ocean", "green", "mouse", "carrot", "sun", "moon", "flower",
    "bottle", "letter", "planet", "kitten", "butter", "cookie", "jungle", "zebra", "violin",
    "honey", "ladder",
)  # fmt: skip


def _string(rng: random.Random, level: int) -> tuple[str, str, str]:
    """One string question -> (question, answer, extractor). Higher levels add harder kinds."""
    kinds = ["first", "length"] + (["last", "reverse", "alpha"] if level >= 2 else [])
    kinds += ["count"] if level >= 3 else []
    kind = rng.choice(kinds)
    word = rng.choice(WORDS)
    if kind == "first":
        return f"What is the first letter of the word '{word}'?", word[0], "exact"
    if kind == "last":
        return f"What is the last letter of the word '{word}'?", word[-1], "exact"
    if kind == "length":
        return f"How many letters are in the word '{word}'?", str(len(word)), "number"
    if kind == "reverse":
        return f"Reverse the word '{word}'.", word[::-1], "exact"
    if kind == "alpha":
        a, b = rng.sample(WORDS, 2)
        return f"Which word comes first alphabetically: '{a}' or '{b}'?", min(a, b), "exact"
    letter = rng.choice(sorted(set(word)))
    question = f"How many times does the letter '{letter}' appear in the word '{word}'?"
    return question, str(word.count(letter)), "number"


def string_tasks(num: int, seed: int = 0, level: int = 1) -> list[Problem]:
    """`num` string questions over the fixed `WORDS` list, checked exactly or as a number."""
    rng = random.Random(seed)
    problems = []
    for i in range(num):
        question, answer, extractor = _string(rng, level)
        suffix = _FINAL_NUMBER if extractor == "number" else _FINAL_WORD
        problems.append(
            Problem(f"string-L{level}-s{seed}-{i}", f"{question}\n{suffix}", answer, extractor)
        )
    return problems


# -- multiple choice ---------------------------------------------------------------------------

# (question, correct option, wrong options): three wrong ones are drawn per problem.
_FACTS = (
    ("What is the capital of France?", "Paris", ("London", "Berlin", "Madrid", "Rome")),
    ("How many legs does a spider have?", "8", ("6", "4", "10", "12")),
    ("How many days are in a week?", "7", ("5", "6", "8", "10")),
    ("Which planet is known as the Red Planet?", "Mars", ("Venus", "Jupiter", "Saturn", "Earth")),
    ("What color is the sky on a clear day?", "blue", ("green", "red", "yellow", "purple")),
    ("What is the opposite of 'hot'?", "cold", ("warm", "big", "fast", "loud")),
    ("Which animal says 'moo'?", "cow", ("dog", "cat", "duck", "sheep")),
    ("What do bees make?", "honey", ("milk", "silk", "wool", "bread")),
    ("How many months are in a year?", "12", ("10", "11", "13", "14")),
    ("What is frozen water called?", "ice", ("steam", "sand", "glass", "salt")),
    ("Which is the largest ocean on Earth?", "Pacific", ("Atlantic", "Indian", "Arctic")),
    ("How many hours are in a day?", "24", ("12", "20", "30", "60")),
)
LETTERS = "ABCD"


def _choice(rng: random.Random, level: int) -> tuple[str, list[str], int]:
    """One question -> (question, four options, index of the correct one)."""
    if rng.random() < 0.5:
        question, correct, wrong_pool = rng.choice(_FACTS)
        wrong = rng.sample(wrong_pool, 3)
    else:
        bound = (10, 20, 13)[level - 1]
        a, b = rng.randint(2, bound - 1), rng.randint(2, bound - 1)
        op = rng.choice(("+", "-")) if level < 3 else "*"
        if op == "-":
            a, b = max(a, b), min(a, b)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question, correct = f"What is {a} {op} {b}?", str(value)
        nearby = [value + d for d in (-3, -2, -1, 1, 2, 3) if value + d >= 0]
        wrong = [str(v) for v in rng.sample(nearby, 3)]
    position = rng.randrange(len(LETTERS))
    options = wrong[:position] + [correct] + wrong[position:]
    return question, options, position


def choice_tasks(num: int, seed: int = 0, level: int = 1) -> list[Problem]:
    """`num` four-option questions (facts or arithmetic); the correct letter's place is seeded."""
    rng = random.Random(seed)
    problems = []
    for i in range(num):
        question, options, position = _choice(rng, level)
        lines = [question] + [f"({letter}) {o}" for letter, o in zip(LETTERS, options)]
        prompt = "\n".join(lines + [_FINAL_LETTER])
        problems.append(
            Problem(f"choice-L{level}-s{seed}-{i}", prompt, LETTERS[position], "choice")
        )
    return problems


# -- answer formats ----------------------------------------------------------------------------

_FINAL_LINE = re.compile(r"\nEnd your reply with 'Final answer: <(?:number|answer|letter)>'\.$")
_PLACEHOLDER = {"number": "<number>", "choice": '"<letter>"', "exact": '"<answer>"',
                "boxed": '"<answer>"'}


def answer_schema(problem: Problem) -> dict:
    """The JSON schema of a reply `{"answer": ...}` to `problem` (required, nothing else), with
    a "reasoning" string of at most 256 characters first for "reasoning_schema".

    The answer's type follows the extractor: "choice" an enum of the letters A-D, "exact" and
    "boxed" a string, "number" an integer where the reference is one (every built-in task),
    else a JSON number, or a string "a/b" for a fraction.
    """
    if problem.extractor == "choice":
        answer: dict = {"enum": list(LETTERS)}
    elif problem.extractor != "number":
        answer = {"type": "string", "minLength": 1, "maxLength": 64}
    else:
        reference = normalize_reference(problem.answer, "number") or ""
        answer = ({"type": "string", "pattern": "^-?[0-9]+/[0-9]+$"} if "/" in reference else
                  {"type": "integer"} if re.fullmatch(r"-?\d+", reference) else
                  {"type": "number"})
    properties = {"answer": answer}
    if problem.answer_format == "reasoning_schema":
        properties = {"reasoning": {"type": "string", "maxLength": _REASONING_CHARS}, **properties}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def with_answer_format(problems: Sequence[Problem], answer_format: str) -> list[Problem]:
    """The problems asking for their answer in `answer_format` (one of ANSWER_FORMATS).

    For "json" and "schema" the built-in "End your reply with 'Final answer: ...'" line becomes
    'Reply only with JSON: {"answer": <number>}.' (with "reasoning_schema":
    '{"reasoning": "<your steps>", "answer": <number>}'; a prompt without that line gets it
    appended); "text" leaves the prompt as it is.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}")
    out = []
    for p in problems:
        prompt = p.prompt
        if answer_format != "text":
            reasoning = ('"reasoning": "<your steps>", ' if answer_format == "reasoning_schema"
                         else "")
            line = f'Reply only with JSON: {{{reasoning}"answer": {_PLACEHOLDER[p.extractor]}}}.'
            prompt = f"{_FINAL_LINE.sub('', prompt)}\n{line}"
        out.append(dataclasses.replace(p, prompt=prompt, answer_format=answer_format))
    return out


TASKS: dict[str, Callable[..., list[Problem]]] = {
    "arithmetic": arithmetic_tasks,
    "string": string_tasks,
    "choice": choice_tasks,
}


# -- loading and saving ------------------------------------------------------------------------


def load_tasks(
    name_or_path: str | Path, num: int | None = None, seed: int = 0, level: int = 1
) -> list[Problem]:
    """A built-in task by name ("arithmetic" | "string" | "choice") or a JSONL file.

    Args:
      name_or_path: a name in TASKS, or the path of a JSONL file (format in the module doc).
      num: how many problems: built-in tasks generate this many (default 100); a file gives its
        first `num` (default all).
      seed: the built-in generator's seed (a file ignores it).
      level: built-in difficulty, 1..3 (a file ignores it).
    """
    if num is not None and num < 1:
        raise ValueError(f"num={num} must be >= 1")
    if not 1 <= level <= 3:
        raise ValueError(f"level={level} must be 1, 2 or 3")
    if str(name_or_path) in TASKS:
        return TASKS[str(name_or_path)](100 if num is None else num, seed=seed, level=level)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"{str(name_or_path)!r} is neither a built-in task ({', '.join(TASKS)}) nor a file"
        )
    problems = _read_jsonl(path)
    return problems if num is None else problems[:num]


def _read_jsonl(path: Path) -> list[Problem]:
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                 f"at column {e.start + 1})") from None
            if not line.strip():
                continue
            problem = _parse_line(line, f"{path}:{lineno}", f"{path.stem}-{lineno}")
            if problem.id in seen:
                first = seen[problem.id]
                raise ValueError(
                    f"{path}:{lineno}: duplicate id {problem.id!r} (first: line {first})"
                )
            seen[problem.id] = lineno
            problems.append(problem)
    if not problems:
        raise ValueError(f"{path}: no problems (the file is empty)")
    return problems


def _parse_line(line: str, where: str, default_id: str) -> Problem:
    """One JSONL line -> Problem; errors say where and which field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {"id", "prompt", "answer", "extractor", "answer_format"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
    answer = obj.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    elif isinstance(answer, float) and math.isfinite(answer):
        answer = format(Decimal(repr(answer)), "f")  # 1e20 -> "100000000000000000000"
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"{where}: field 'answer' must be a non-empty string or number")
    extractor = obj.get("extractor", "number")
    if not isinstance(extractor, str) or extractor not in EXTRACTORS:
        raise ValueError(
            f"{where}: field 'extractor' is {extractor!r}; valid: {', '.join(EXTRACTORS)}"
        )
    if normalize_reference(answer, extractor) is None:
        raise ValueError(
            f"{where}: field 'answer' {answer!r} has no answer that extractor {extractor!r} reads"
        )
    problem_id = obj.get("id", default_id)
    if isinstance(problem_id, int) and not isinstance(problem_id, bool):
        problem_id = str(problem_id)
    if not isinstance(problem_id, str) or not problem_id:
        raise ValueError(f"{where}: field 'id' must be a non-empty string, got {problem_id!r}")
    answer_format = obj.get("answer_format", "text")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"{where}: field 'answer_format' is {answer_format!r}; valid: "
                         f"{', '.join(ANSWER_FORMATS)}")
    return Problem(problem_id, prompt, answer, extractor, answer_format)


def save_jsonl(problems: Sequence[Problem], path: str | Path) -> None:
    """Write problems in the JSONL format `load_tasks` reads (one object per line, UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            record = {"id": p.id, "prompt": p.prompt, "answer": p.answer, "extractor": p.extractor}
            if p.answer_format != "text":
                record["answer_format"] = p.answer_format
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
