"""jaxinfer.tts without devices: extractors, voting, pass@k, tasks, and the strategies over a fake
sampler."""

import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import pytest

from jaxinfer.cli.tts import self_consistency_rows
from jaxinfer.tts import (
    TASKS,
    Problem,
    Sample,
    answer_of,
    answer_schema,
    best_of_n,
    extract_boxed,
    extract_choice,
    extract_exact,
    extract_json_answer,
    extract_number,
    get_extractor,
    load_tasks,
    majority_vote,
    mean_pass_at_k,
    pass_at_k,
    pass_at_k_curve,
    repeated_sampling,
    save_jsonl,
    self_consistency,
    summary_table,
    verify,
    with_answer_format,
)

# -- extractors --------------------------------------------------------------------------------

NUMBER_CASES = [
    ("The answer is 12, not 13.", "12"),
    ("-3.50", "-3.5"),
    ("It costs $12.", "12"),
    ("Final answer: 1,234", "1234"),
    ("Answer: $1,234.50 in total", "1234.5"),
    ("We get 12.0", "12"),
    ("about 3/4 of them", "3/4"),
    ("Final answer: -3/4", "-3/4"),
    ("#### -5", "-5"),
    ("3 + 4 = 7. Final answer: 7.", "7"),
    ("The answer is 3 + 4 = 7.", "7"),
    ("Final answer: 7\n\n3 + 4 = 8", "7"),
    ("First 5, then 6, finally 9.", "9"),
    ("10-3 is 7", "7"),
    ("so 5 - 3", "3"),
    ("Tom has -2 degrees", "-2"),
    ("**Final answer:** 42", "42"),
    ("Final answer is 8 apples. (I counted 3 twice.)", "8"),
    ("The answer is 4. Hmm, wait. The answer is 5.", "5"),
    ("The answer isn't 5; I get 6", "6"),
    ("Final answer: seven, since 3 + 4 = 7", "3"),
    (r"so $\boxed{\frac{1}{2}}$ remains", "1/2"),
    (r"\boxed{-3.50} and later 99", "-3.5"),
    (r"\boxed{x = 2 + 3 = 5}", "5"),
    ("a list 1,2,3", "3"),
    ("0.50", "0.5"),
    (".5 of a cup", "0.5"),
    ("007", "7"),
    ("-0", "0"),
    ("1,2345", "2345"),
    ("no numbers at all", None),
    ("", None),
]


@pytest.mark.parametrize("text, expected", NUMBER_CASES)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


CHOICE_CASES = [
    ("(B)", "B"),
    ("B)", "B"),
    ("b", "B"),
    ("(c).", "C"),
    ("answer is C", "C"),
    ("Answer: d", "D"),
    ("Final answer: D.", "D"),
    ("The correct option is (c) 13", "C"),
    ("I think it is (A) 11.", "A"),
    ("B. 12", "B"),
    ("The answer is (A), not (B)", "A"),
    ("(A) 11 looks wrong; Answer: B", "B"),
    ("the answer is a bit unclear", None),
    ("A cat sat on the mat", None),
    ("The answer is E", None),
    ("", None),
]


@pytest.mark.parametrize("text, expected", CHOICE_CASES)
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


def test_extract_choice_other_letters():
    assert extract_choice("Answer: E", choices="ABCDE") == "E"
    assert extract_choice("(b)", choices="ab") == "B"
    with pytest.raises(ValueError, match="choices"):
        extract_choice("A", choices="A1")


BOXED_CASES = [
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"first \boxed{1}, then \boxed{ x{y}z }", "x{y}z"),
    (r"\boxed{1} then \boxed{oops", None),
    (r"\fbox{7}", "7"),
    ("no box", None),
]


@pytest.mark.parametrize("text, expected", BOXED_CASES)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


EXACT_CASES = [
    ("Final answer: 'Tac'.", "tac"),
    ("Reasoning...\n**Final answer:** Apple\nThanks!", "apple"),
    ("final answer is b", "b"),
    ("  Banana  ", "banana"),
    ("Final answer:", None),
]


@pytest.mark.parametrize("text, expected", EXACT_CASES)
def test_extract_exact(text, expected):
    assert extract_exact(text) == expected


@pytest.mark.parametrize(
    "name, cases",
    [("number", NUMBER_CASES), ("choice", CHOICE_CASES), ("exact", EXACT_CASES)],
)
def test_extractors_are_fixed_points(name, cases):
    """verify() runs the extractor on the reference answer too: f(f(x)) must equal f(x)."""
    extract = get_extractor(name)
    for text, _ in cases:
        once = extract(text)
        if once is not None:
            assert extract(once) == once, (text, once)


def test_get_extractor():
    assert get_extractor("number") is extract_number
    assert get_extractor("boxed") is extract_boxed
    with pytest.raises(ValueError, match=r"'numbers'.*number, choice, boxed, exact"):
        get_extractor("numbers")


# -- voting ------------------------------------------------------------------------------------


def test_majority_vote():
    vote = majority_vote(["5", "6", "5", None, "7"])
    assert (vote.answer, vote.num_valid, vote.counts) == ("5", 4, {"5": 2, "6": 1, "7": 1})
    assert vote.agreement == pytest.approx(2 / 4)


def test_majority_vote_tie_goes_to_first_seen():
    assert majority_vote(["6", "5", "5", "6"]).answer == "6"
    assert majority_vote([None, "b", "a"]).answer == "b"


def test_majority_vote_none_abstains():
    vote = majority_vote([None, None, "3"])
    assert (vote.answer, vote.agreement, vote.num_valid) == ("3", 1.0, 1)
    for answers in ([], [None, None]):
        vote = majority_vote(answers)
        assert (vote.answer, vote.counts, vote.agreement, vote.num_valid) == (None, {}, 0.0, 0)


# -- pass@k ------------------------------------------------------------------------------------


def test_pass_at_k_matches_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_edges():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # n - c = 4 < k: every 5-subset has a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)  # large n: no overflowing binomials


@pytest.mark.parametrize(
    "n, c, k, match",
    [(5, 6, 1, "c=6, n=5"), (5, -1, 1, "c=-1"), (5, 2, 0, "k=0, n=5"), (5, 2, 6, "k=6, n=5")],
)
def test_pass_at_k_validates(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_pass_at_k_curve_and_mean():
    curve = pass_at_k_curve(4, 1, [1, 2, 4])
    assert curve == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})
    assert mean_pass_at_k([(4, 1), (4, 0), (2, 2)], 1) == pytest.approx((0.25 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="at least one"):
        mean_pass_at_k([], 1)
    with pytest.raises(ValueError, match="k=3, n=2"):
        mean_pass_at_k([(4, 1), (2, 1)], 3)


# -- tasks -------------------------------------------------------------------------------------


def _wrong(problem: Problem) -> str:
    if problem.extractor == "choice":
        return "BCDA"["ABCD".index(problem.answer)]
    if problem.extractor == "number":
        return str(int(problem.answer) + 1)
    return problem.answer + "x"


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("level", [1, 2, 3])
def test_tasks_deterministic_and_self_verifying(name, level):
    problems = load_tasks(name, num=40, seed=7, level=level)
    assert problems == load_tasks(name, num=40, seed=7, level=level)
    assert problems != load_tasks(name, num=40, seed=8, level=level)
    assert len(problems) == 40 and len({p.id for p in problems}) == 40
    for p in problems:
        assert "Final answer:" in p.prompt
        assert verify(p, p.answer), p
        assert verify(p, f"Let me think.\nFinal answer: {p.answer}"), p
        assert not verify(p, f"Final answer: {_wrong(p)}"), p
        assert not verify(p, "I don't know"), p


def test_task_generation_uses_no_global_random_state():
    import random

    random.seed(1)
    first = load_tasks("arithmetic", num=5, seed=3)
    random.seed(2)
    assert load_tasks("arithmetic", num=5, seed=3) == first


def test_arithmetic_levels_respect_number_sizes():
    for level, bound in ((1, 10), (2, 20)):
        for p in load_tasks("arithmetic", num=50, seed=0, level=level):
            question = p.prompt.split("\n")[0]
            assert all(int(x) < bound for x in re.findall(r"\d+", question)), question
            assert int(p.answer) >= 0
    assert all("boxes" in p.prompt for p in load_tasks("arithmetic", num=10, level=3))


def test_choice_tasks_correct_option_and_positions():
    problems = load_tasks("choice", num=60, seed=0)
    assert {p.answer for p in problems} == set("ABCD")  # the seed moves the correct letter
    for p in problems:
        match = re.match(r"What is (\d+) ([-+]) (\d+)\?", p.prompt)
        if match:
            a, op, b = int(match[1]), match[2], int(match[3])
            options = dict(re.findall(r"\(([A-D])\) (\S+)", p.prompt))
            assert int(options[p.answer]) == (a + b if op == "+" else a - b)
            assert len(set(options.values())) == 4


def test_string_tasks_answers():
    for p in load_tasks("string", num=60, seed=1, level=3):
        words = re.findall(r"'([a-z]+)'", p.prompt)
        if p.prompt.startswith("Reverse"):
            assert p.answer == words[0][::-1]
        elif p.prompt.startswith("How many letters"):
            assert p.answer == str(len(words[0]))
        elif p.prompt.startswith("Which word"):
            assert p.answer == min(words)


def test_jsonl_round_trip(tmp_path):
    problems = [p for name in sorted(TASKS) for p in load_tasks(name, num=5, seed=2, level=2)] + [
        Problem("ü-1", "Mitte: 1/2 + 1/4?", "3/4", "number"),
        Problem("b", "Box it", "1/2", "boxed"),
        Problem("j", "2 + 2?", "4", "number", "schema"),
    ]
    path = tmp_path / "problems.jsonl"
    save_jsonl(problems, path)
    assert load_tasks(path) == problems
    assert load_tasks(str(path), num=3) == problems[:3]


def test_jsonl_defaults(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "2 + 3?", "answer": 5}\n\n{"prompt": "x", "answer": 2.5, "id": 7}\n'
    )
    assert load_tasks(path) == [Problem("mine-1", "2 + 3?", "5"), Problem("7", "x", "2.5")]


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"prompt": "a", "answer": "1"}', "{oops"], r"bad\.jsonl:2: invalid JSON"),
        (["[1, 2]"], r":1: expected a JSON object"),
        (['{"answer": "1"}'], r":1: field 'prompt'"),
        (['{"prompt": "a"}'], r":1: field 'answer'"),
        (['{"prompt": "a", "answer": true}'], r":1: field 'answer'"),
        (['{"prompt": "a", "answer": "1", "extractor": "regex"}'], r":1: field 'extractor'"),
        (['{"prompt": "a", "answer": "1", "extractor": ["number"]}'], r":1: field 'extractor'"),
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "\xff"}'],
         r":2: not UTF-8 text \(byte 0xff at column 13\)"),
        (['{"prompt": "a", "answer": "seven"}'], r":1: field 'answer' 'seven'.*'number'"),
        (['{"prompt": "a", "answer": "12", "extractor": "choice"}'], r":1: field 'answer'"),
        (['{"prompt": "a", "answer": "1", "id": ""}'], r":1: field 'id'"),
        (['{"prompt": "a", "answer": "1", "hint": 2}'], r":1: unknown field\(s\) \['hint'\]"),
        (['{"prompt": "a", "answer": "1", "id": "q"}'] * 2, r":2: duplicate id 'q'.*line 1"),
        ([], r"no problems"),
    ],
)
def test_jsonl_errors(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))
    with pytest.raises(ValueError, match=match):
        load_tasks(path)


def test_load_tasks_errors(tmp_path):
    with pytest.raises(ValueError, match=r"'algebra' is neither a built-in task \(arithmetic"):
        load_tasks("algebra")
    with pytest.raises(ValueError, match="level=4"):
        load_tasks("arithmetic", level=4)
    with pytest.raises(ValueError, match="num=0"):
        load_tasks("arithmetic", num=0)
    assert len(load_tasks("string")) == 100


# -- structured answers ------------------------------------------------------------------------


@pytest.mark.parametrize("text, extractor, expected", [
    ('{"answer": 12}', "number", "12"),
    ('{"answer":12.50}', "number", "12.5"),
    ('{"answer": 1e2}', "number", "100"),
    ('{"answer": "3/4"}', "number", "3/4"),
    ('{"answer":"C"}', "choice", "C"),
    ('{"answer": "Tac."}', "exact", "tac"),
    ('{"answer": 12', "number", None),  # cut by max_new_tokens
    ("Final answer: 12", "number", None),  # not JSON: nothing is guessed
    ('{"result": 12}', "number", None),
    ('{"answer": true}', "number", None),
    ('{"answer": [12]}', "number", None),
    ("[12]", "number", None),
])
def test_extract_json_answer(text, extractor, expected):
    assert extract_json_answer(text, extractor) == expected


@pytest.mark.parametrize("name", sorted(TASKS))
def test_answer_formats_ask_for_and_parse_json(name):
    problems = load_tasks(name, num=20, seed=3, level=2)
    assert with_answer_format(problems, "text") == problems
    for fmt in ("json", "schema", "reasoning_schema"):
        for p, q in zip(problems, with_answer_format(problems, fmt)):
            assert q.answer_format == fmt and q.answer == p.answer
            assert "Final answer" not in q.prompt and q.prompt.endswith("}.")
            assert q.prompt.split("\n")[:-1] == p.prompt.split("\n")[:-1]
            schema = answer_schema(q)
            reasoning = {"reasoning": "I count."} if fmt == "reasoning_schema" else {}
            reply = json.dumps({**reasoning, "answer": int(q.answer) if schema["properties"][
                "answer"].get("type") == "integer" else q.answer})
            jsonschema.validate(json.loads(reply), schema)
            assert verify(q, reply) and answer_of(q, reply) is not None
            assert not verify(q, f"Final answer: {q.answer}")  # text is not a JSON reply
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({"answer": q.answer, "why": "x"}, schema)
    with pytest.raises(ValueError, match="answer_format='yaml'"):
        with_answer_format(problems, "yaml")


def test_answer_schema_types_follow_the_reference():
    def kind(answer, extractor="number"):
        return answer_schema(Problem("p", "q", answer, extractor))["properties"]["answer"]

    assert kind("12") == {"type": "integer"} and kind("-3") == {"type": "integer"}
    assert kind("2.5") == {"type": "number"}
    assert kind("3/4")["pattern"] == "^-?[0-9]+/[0-9]+$"
    assert kind("B", "choice") == {"enum": ["A", "B", "C", "D"]}
    assert kind("tac", "exact")["type"] == "string"


def test_self_consistency_rows_count_samples_without_an_answer():
    problems = with_answer_format(load_tasks("arithmetic", num=2, seed=0), "json")
    right = [json.dumps({"answer": int(p.answer)}) for p in problems]
    texts = [[right[0], right[0], '{"answer": 1', "Final answer: " + problems[0].answer],
             ['{"answer": -1}', right[1], right[1], "{"]]
    samples = [[Sample(t) for t in row] for row in texts]
    rows = {r["n"]: r for r in self_consistency_rows(problems, samples)}
    assert rows[4]["no_answer"] == 3 / 8 and rows[4]["majority_acc"] == 1.0
    assert rows[4]["single_acc"] == 4 / 8
    assert rows[1]["no_answer"] == 0 and rows[1]["majority_acc"] == 0.5


# -- strategies --------------------------------------------------------------------------------


class FakeSampler:
    """Deterministic: each prompt's completions are its scripted texts in order, cycling."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = script
        self.cursor = dict.fromkeys(script, 0)
        self.calls: list[tuple[list[str], int]] = []

    def sample(self, prompts: Sequence[str], n: int) -> list[list[Sample]]:
        self.calls.append((list(prompts), n))
        rows = []
        for prompt in prompts:
            texts = self.script[prompt]
            row = []
            for _ in range(n):
                text = texts[self.cursor[prompt] % len(texts)]
                self.cursor[prompt] += 1
                row.append(Sample(text, num_tokens=len(text.split()), prompt_tokens=3))
            rows.append(row)
        return rows


def test_self_consistency():
    texts = ["Final answer: 5", "Final answer: 6", "so 5", "no idea", "Final answer: 6.0"]
    sampler = FakeSampler({"q": texts})
    result = self_consistency(sampler, "q", 5, extract_number)
    assert result.answers == ["5", "6", "5", None, "6"]
    assert result.answer == "5"  # 2-2 tie: "5" appeared first
    assert (result.vote.num_valid, result.vote.agreement) == (4, 0.5)
    assert [s.text for s in result.samples] == texts
    assert sampler.calls == [(["q"], 5)]
    assert self_consistency(FakeSampler({"q": ["(B)", "C", "b"]}), "q", 3, "choice").answer == "B"


def test_best_of_n_highest_score_first_on_ties():
    scores = {"a": 0.2, "b": 0.9, "c": 0.9, "d": 0.1}
    result = best_of_n(FakeSampler({"q": list(scores)}), "q", 4, scores.__getitem__)
    assert (result.index, result.best.text, result.num_drawn) == (1, "b", 4)
    assert result.passed == [False] * 4  # no score reaches the default pass_threshold of 1.0
    result = best_of_n(FakeSampler({"q": list(scores)}), "q", 4, scores.get, pass_threshold=0.5)
    assert result.passed == [False, True, True, False]


def test_best_of_n_stops_at_first_passing_batch():
    texts = ["wrong"] * 10 + ["right", "right"] + ["wrong"] * 20
    sampler = FakeSampler({"q": texts})
    result = best_of_n(sampler, "q", 32, lambda t: t == "right", stop_on_first_pass=True, batch=4)
    assert (result.index, result.num_drawn, result.best.text) == (10, 12, "right")
    assert [n for _, n in sampler.calls] == [4, 4, 4]
    assert result.passed == [False] * 10 + [True, True]
    assert len(result.samples) == len(result.scores) == 12


def test_best_of_n_early_stopping_without_a_pass():
    sampler = FakeSampler({"q": ["wrong"]})
    result = best_of_n(sampler, "q", 10, lambda t: False, stop_on_first_pass=True, batch=4)
    assert (result.best, result.index, result.num_drawn) == (None, None, 10)
    assert [n for _, n in sampler.calls] == [4, 4, 2]  # never more than n
    with pytest.raises(ValueError, match="batch=0"):
        best_of_n(sampler, "q", 10, bool, stop_on_first_pass=True, batch=0)


def test_repeated_sampling():
    problems = [Problem("p0", "q0", "4"), Problem("p1", "q1", "B", "choice")]
    sampler = FakeSampler(
        {"q0": ["Final answer: 4", "Final answer: 5", "3", "4.0"], "q1": ["(A)", "(C)", "(D)", "x"]}
    )
    result = repeated_sampling(sampler, problems, k_max=4)
    assert sampler.calls == [(["q0", "q1"], 4)]  # one batched call over problems
    assert result.correct == [[True, False, False, True], [False] * 4]
    assert result.per_problem == [(4, 2), (4, 0)]
    assert list(result.pass_at_k) == [1, 2, 3, 4]
    for k, value in result.pass_at_k.items():
        assert value == pytest.approx(mean_pass_at_k([(4, 2), (4, 0)], k))
    assert result.pass_at_k[4] == pytest.approx(0.5)

    custom = repeated_sampling(FakeSampler({"q0": ["x"]}), problems[:1], 2, lambda p, t: True)
    assert custom.per_problem == [(2, 2)] and custom.pass_at_k == {1: 1.0, 2: 1.0}


def test_sampler_output_shape_is_checked():
    class Short(FakeSampler):
        def sample(self, prompts, n):
            return super().sample(prompts, n - 1)

    with pytest.raises(ValueError, match=r"sizes \[2\]; expected 1 x 3"):
        self_consistency(Short({"q": ["1"]}), "q", 3, extract_number)


def test_summary_table():
    rows = [
        {"strategy": "greedy", "n": 1, "accuracy": 0.25},
        {"strategy": "self-consistency", "n": 16, "accuracy": 0.5, "note": None},
    ]
    table = summary_table(rows, ["strategy", "n", "accuracy", "note"])
    assert table.split("\n") == [
        "strategy           n  accuracy  note",
        "----------------  --  --------  ----",
        "greedy             1    0.2500  -",
        "self-consistency  16    0.5000  -",
    ]


# -- no jax ------------------------------------------------------------------------------------


def test_tts_imports_no_jax():
    code = (
        "import sys, jaxinfer.tts\n"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib'))]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
