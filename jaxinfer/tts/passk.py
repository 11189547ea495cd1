"""pass@k with the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", Codex paper).

Draw n >= k samples of a problem, c of them correct. The probability that at least one of k
samples drawn without replacement from those n is correct is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

the product form being the numerically stable one (no huge binomials). Estimating pass@k as
1 - (1 - c/n)^k instead is biased low; the unbiased form is what makes curves for different k
from the same n samples comparable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def _check(n: int, c: int, k: int) -> None:
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples of which c are correct.

    Returns 1.0 when n - c < k (every size-k subset holds a correct sample).
    Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    _check(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_curve(n: int, c: int, ks: Iterable[int]) -> dict[int, float]:
    """pass@k for each k in `ks`, from the same n samples: {k: pass@k}."""
    return {k: pass_at_k(n, c, k) for k in ks}


def mean_pass_at_k(per_problem: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems; per_problem holds one (n, c) per problem.

    Problems may have different n (each needs n >= k). Raises ValueError if there are none.
    """
    if not per_problem:
        raise ValueError("mean_pass_at_k needs at least one (n, c) pair")
    return sum(pass_at_k(n, c, k) for n, c in per_problem) / len(per_problem)
