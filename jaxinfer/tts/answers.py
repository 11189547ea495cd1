"""Answer extractors: a completion's text -> a normalized answer string, or None if none is found.

Self-consistency votes over these strings and verifiers compare them, so two completions that
mean the same answer must extract to the same string ("$1,234.50" and "1234.5" both -> "1234.5").
Every extractor is also applied to a problem's reference answer (`tasks.verify`), so it must be a
fixed point on its own output: `f(f(text)) == f(text)`.

Markers win over position: a small model often writes "The answer is 12, not 13." or revises
itself, so the text after the LAST explicit marker ("Final answer:", "The answer is", "Answer:",
"####", `\\boxed{}`) decides, and only without a marker does the last number in the text count.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

Extractor = Callable[[str], "str | None"]

# A number: optional sign (a '-' right after a word character or ')' is a binary minus, not a
# sign), optional '$', then thousands-grouped | fraction | decimal | integer. The lookahead stops
# "1,2345" from reading as "1,234" and "3/4/5" from reading as "3/4".
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)\]])[-\u2212])?\$?"
    r"(?P<body>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+/\d+|\d*\.\d+|\d+)(?![\d/])"
)
_NUMBER_MARKER = re.compile(r"final\s+answer|answer\s+is\b|answer\s*[:=]|####", re.IGNORECASE)
# "The answer is 3 + 4 = 7": skip a plain arithmetic expression up to its last '='.
_EXPRESSION = re.compile(r"[ \t\d+\-*/\u00d7\u00f7x.,$()]*=\s*")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_EXACT_MARKER = re.compile(r"final\s+answer\s*(?:is)?\s*\**\s*[:=]?", re.IGNORECASE)
# Stripped from both ends of an "exact" answer: whitespace, quotes, markdown emphasis, end marks.
_EXACT_STRIP = " \t\r\n\"'`*.!"


def normalize_number(sign: str, body: str) -> str:
    """One matched number -> canonical text: no '$' or thousands commas, no trailing zeros.

    Integers print without a decimal point ("12.0" -> "12"); fractions stay as written ("3/4");
    zero is never negative.
    """
    body = body.replace(",", "")
    if "/" in body:
        numerator, denominator = body.split("/")
        return f"{'-' if sign else ''}{int(numerator)}/{int(denominator)}"
    try:
        value = Decimal(body)
    except InvalidOperation:  # unreachable for _NUMBER's bodies; kept as a guard
        return body
    if sign:
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _numbers(text: str) -> list[str]:
    return [normalize_number(m["sign"] or "", m["body"]) for m in _NUMBER.finditer(text)]


def _boxed_contents(text: str) -> list[tuple[int, str | None]]:
    """(start offset, content) of every `\\boxed{...}`; content None where braces don't balance."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found.append((match.start(), text[start:i]))
                    break
        else:
            found.append((match.start(), None))
    return found


def extract_boxed(text: str) -> str | None:
    """Content of the LAST `\\boxed{...}` (nested braces balanced), stripped.

    Returns None if there is no `\\boxed{` or the last one is never closed.
    `extract_boxed(r"so \\boxed{\\frac{1}{2}}.") == r"\\frac{1}{2}"`.
    """
    found = _boxed_contents(text)
    if not found or found[-1][1] is None:
        return None
    return found[-1][1].strip()


def extract_number(text: str) -> str | None:
    """The final numeric answer of `text`, normalized (see `normalize_number`), or None.

    Looks at the last explicit marker that is followed by a number: `\\boxed{}` gives the last
    number inside it (`\\frac{a}{b}` reads as "a/b"); "Final answer:", "The answer is",
    "Answer:" and "####" give the first number after them ("The answer is 12, not 13." -> "12"),
    skipping an arithmetic expression up to its '=' ("The answer is 3 + 4 = 7" -> "7").
    Without a usable marker, the last number in the text.
    """
    candidates: list[tuple[int, str]] = []  # (position of the marker, its number)
    for start, content in _boxed_contents(text):
        numbers = _numbers(_FRAC.sub(r"\1/\2", content)) if content is not None else []
        if numbers:
            candidates.append((start, numbers[-1]))
    for match in _NUMBER_MARKER.finditer(text):
        rest = text[match.end() :]
        expression = _EXPRESSION.match(rest)
        numbers = _numbers(rest[expression.end() :] if expression else rest) or _numbers(rest)
        if numbers:
            candidates.append((match.start(), numbers[0]))
    if candidates:
        return max(candidates, key=lambda c: c[0])[1]
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def extract_choice(text: str, choices: str = "ABCD") -> str | None:
    """The multiple-choice letter a completion picks, upper-case, or None.

    In order of preference: the last letter after a marker ("answer is C", "Answer: d",
    "correct option: (B)"); a text that is only a letter ("b", "(C)."); the last
    parenthesized/closed letter ("(B)", "B)"); a letter opening the text ("B. 12"). A bare
    lower-case letter after a marker counts only when nothing but punctuation follows it, so
    "the answer is a bit unclear" picks nothing.
    """
    if not choices or not all(len(c) == 1 and c.isalpha() for c in choices):
        raise ValueError(f"choices={choices!r} must be a non-empty string of letters")
    letters = "".join(sorted(set(choices.upper() + choices.lower())))
    cls = f"[{re.escape(letters)}]"
    marker = re.compile(
        r"(?:answer|option|choice)\s*(?:is\s*)?\**\s*[:=]?\s*\**\s*(?:option\s+|choice\s+)?"
        rf"(?P<open>\()?(?P<letter>{cls})(?P<close>\))?(?![A-Za-z])(?P<after>\s*(?:$|[.,;:!*\n]))?",
        re.IGNORECASE,
    )
    picks = [
        m["letter"]
        for m in marker.finditer(text)
        if m["letter"].isupper() or m["open"] or m["after"] is not None
    ]
    if picks:
        return picks[-1].upper()
    alone = re.fullmatch(rf"\s*\(?({cls})\)?[.:)]?\s*", text)
    if alone:
        return alone[1].upper()
    closed = re.findall(rf"(?<![A-Za-z])\(?({cls})\)", text)
    if closed:
        return closed[-1].upper()
    opening = re.match(rf"\s*([{re.escape(choices.upper())}])[.:]", text)
    return opening[1] if opening else None


def extract_exact(text: str) -> str | None:
    """The whole answer as text, for exact comparison: casefolded, outer quotes and periods gone.

    With a "Final answer:" marker, the rest of the line after the last one; otherwise the whole
    text. Strips whitespace, quotes, markdown '*' and trailing '.'/'!' from both ends, then
    casefolds: "Final answer: 'Tac'." -> "tac". Empty -> None.
    """
    markers = list(_EXACT_MARKER.finditer(text))
    if markers:
        rest = text[markers[-1].end() :].strip(_EXACT_STRIP)
        text = rest.split("\n", 1)[0]
    answer = text.strip(_EXACT_STRIP).casefold()
    return answer or None


def normalize_reference(answer: str, extractor: str) -> str | None:
    """A problem's reference answer in the form `extractor` produces, or None if it has none.

    Applies the extractor itself, except that "boxed" also accepts the bare content ("1/2" as
    well as "\\boxed{1/2}"), since reference answers are rarely written boxed.
    """
    if extractor == "boxed" and _BOXED.search(answer) is None:
        return answer.strip() or None
    return get_extractor(extractor)(answer)


def extract_json_answer(text: str, extractor: str) -> str | None:
    """The "answer" field of a JSON object reply (`{"answer": 12}`), normalized as `extractor`
    normalizes a reference answer, or None if the text is not such an object.

    For replies asked for as JSON (`tasks.answer_schema`): nothing is guessed, the reply either
    parses or has no answer. A JSON number is read exactly (12.50 -> "12.5", 1e2 -> "100" under
    "number"); true/false/null and nested values are not answers.
    """
    try:
        reply = json.loads(text, parse_float=Decimal)
    except json.JSONDecodeError:
        return None
    value = reply.get("answer") if isinstance(reply, dict) else None
    if isinstance(value, Decimal):
        value = format(value, "f")  # 1e2 -> "100"
    elif isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None
    return normalize_reference(value, extractor)


EXTRACTORS: dict[str, Extractor] = {
    "number": extract_number,
    "choice": extract_choice,
    "boxed": extract_boxed,
    "exact": extract_exact,
}


def get_extractor(name: str) -> Extractor:
    """An extractor by exact name: "number" | "choice" | "boxed" | "exact"."""
    try:
        return EXTRACTORS[name]
    except KeyError:
        raise ValueError(
            f"unknown extractor {name!r}; valid names: {', '.join(EXTRACTORS)}"
        ) from None
