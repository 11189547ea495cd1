"""Test-time scaling without the engine (docs/architecture.md, decision 7): answer extraction,
majority voting, the unbiased pass@k estimator, checkable tasks, and the strategies
(self-consistency, best-of-n, repeated sampling) over an abstract `Sampler`; plus the
engine-backed `EngineSampler` (`tts.sampler`) and reasoning effort as a thinking budget
(`tts.effort`), which take the engine as an argument.

Importing this package imports no jax (the engine modules are imported only when used), so the
engine-independent parts are unit-tested without devices.
"""

from jaxinfer.tts.answers import (
    EXTRACTORS,
    extract_boxed,
    extract_choice,
    extract_exact,
    extract_json_answer,
    extract_number,
    get_extractor,
    normalize_reference,
)
from jaxinfer.tts.effort import (
    DEFAULT_BUDGETS,
    BudgetedCompletion,
    EffortConfig,
    generate_with_budget,
    system_prompt,
)
from jaxinfer.tts.passk import mean_pass_at_k, pass_at_k, pass_at_k_curve
from jaxinfer.tts.sampler import Cost, EngineSampler
from jaxinfer.tts.strategies import (
    BestOfNResult,
    RepeatedSamplingResult,
    Sample,
    Sampler,
    SelfConsistencyResult,
    best_of_n,
    repeated_sampling,
    self_consistency,
    summary_table,
)
from jaxinfer.tts.tasks import (
    ANSWER_FORMATS,
    SCHEMA_FORMATS,
    TASKS,
    Problem,
    answer_of,
    answer_schema,
    is_correct,
    load_tasks,
    save_jsonl,
    verify,
    with_answer_format,
)
from jaxinfer.tts.voting import Vote, majority_vote

__all__ = [
    "ANSWER_FORMATS", "SCHEMA_FORMATS", "answer_of", "answer_schema", "extract_json_answer",
    "is_correct", "with_answer_format",
    "DEFAULT_BUDGETS", "BudgetedCompletion", "Cost", "EffortConfig", "EngineSampler",
    "generate_with_budget", "system_prompt",
    "EXTRACTORS", "TASKS", "BestOfNResult", "Problem", "RepeatedSamplingResult", "Sample",
    "Sampler", "SelfConsistencyResult", "Vote", "best_of_n", "extract_boxed", "extract_choice",
    "extract_exact", "extract_number", "get_extractor", "load_tasks", "majority_vote",
    "mean_pass_at_k", "normalize_reference", "pass_at_k", "pass_at_k_curve", "repeated_sampling",
    "save_jsonl", "self_consistency", "summary_table", "verify",
]  # fmt: skip
