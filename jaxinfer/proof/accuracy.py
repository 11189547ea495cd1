"""How far a model's next-token distributions are from a reference model's on real text.

`compare` teacher-forces one token sequence through every model (the real forward: prompt
chunks written into and read back from each model's own paged KV cache) and reports, per model,
over every position that predicts a next token: the mean KL divergence KL(p_ref || p_model) in
nats, the top-1 agreement (the argmax equals the reference's), and the perplexity of the text.
`scripts/quant_eval.py` runs it for each weight / KV dtype; `tests/test_quant_accuracy.py` on a
slice of the same text.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import CacheConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.model import CHUNK, StepBatch


@dataclasses.dataclass(frozen=True)
class Agreement:
    """Statistics of one model against the reference over `positions` predicted tokens."""

    positions: int
    mean_kl: float  # nats, KL(reference || model)
    top1: float  # fraction of positions whose argmax equals the reference's
    perplexity: float  # of the text under the model
    reference_perplexity: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.partial(jax.jit, static_argnames=("num_pages_read",), donate_argnums=(2, 3))
def _chunk_logits(model, tokens, k_pages, v_pages, start, *, num_pages_read: int):
    """Logits f32[T, V] of `tokens` i32[T] at positions start.. of slot 0, K/V written."""
    t = tokens.shape[0]
    positions = (start + jnp.arange(t, dtype=jnp.int32))[None]
    table = jnp.arange(k_pages[0].shape[-3] - 1, dtype=jnp.int32)[None]
    batch = StepBatch.per_slot(tokens[None], positions, jnp.ones((1, t), bool), table,
                               (start + t)[None], num_pages_read=num_pages_read, kind=CHUNK)
    logits, k_pages, v_pages = model(batch, k_pages, v_pages)
    return logits, k_pages, v_pages


class _Stream:
    """One model's teacher-forced pass over a sequence, a chunk at a time."""

    def __init__(self, model, num_tokens: int, page_size: int, kv_dtype: str | None):
        cache = CacheConfig(page_size=page_size, max_seq_len=num_tokens, dtype=kv_dtype)
        kv = create_cache(model.config, cache, 1)
        self.model, self.k, self.v = model, kv.k_pages, kv.v_pages
        self.num_pages = cache.pages_per_seq

    def logits(self, tokens: np.ndarray, start: int) -> jax.Array:
        logits, self.k, self.v = _chunk_logits(
            self.model, jnp.asarray(tokens, jnp.int32), self.k, self.v, jnp.int32(start),
            num_pages_read=self.num_pages)
        return logits


@jax.jit
def _stats(ref_logits, logits, targets):
    """Sums over rows: KL(ref || model), argmax agreement, -log p_model(target),
    -log p_ref(target)."""
    ref_lp = jax.nn.log_softmax(ref_logits, axis=-1)
    lp = jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)
    same = jnp.argmax(ref_logits, -1) == jnp.argmax(logits, -1)
    nll = -jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    ref_nll = -jnp.take_along_axis(ref_lp, targets[:, None], axis=-1)[:, 0]
    return jnp.stack([kl.sum(), same.sum(), nll.sum(), ref_nll.sum()])


def compare(reference, models: dict, token_ids, *, chunk: int = 256, page_size: int = 16,
            kv_dtypes: dict | None = None) -> dict[str, Agreement]:
    """Agreement of each of `models` ({name: Llama}) with `reference` (a Llama) over
    `token_ids` (positions 0..T-2 predict tokens 1..T-1), fed in prompt chunks of `chunk`.
    `kv_dtypes`: {name: KV cache dtype} for models whose pool is not their weights' dtype
    (the reference's pool: its own dtype)."""
    ids = np.asarray(token_ids, np.int32)
    num = (len(ids) - 1) // chunk * chunk + 1  # whole chunks of predicting positions, + 1
    ids = ids[:num]
    kv_dtypes = kv_dtypes or {}
    ref = _Stream(reference, num, page_size, None)
    streams = {name: _Stream(m, num, page_size, kv_dtypes.get(name)) for name, m in models.items()}
    sums = {name: np.zeros(4) for name in models}
    for start in range(0, num - 1, chunk):
        tokens, targets = ids[start:start + chunk], jnp.asarray(ids[start + 1:start + chunk + 1])
        ref_logits = ref.logits(tokens, start)
        for name, stream in streams.items():
            sums[name] += np.asarray(_stats(ref_logits, stream.logits(tokens, start), targets))
    n = num - 1
    return {name: Agreement(positions=n, mean_kl=s[0] / n, top1=s[1] / n,
                            perplexity=float(np.exp(s[2] / n)),
                            reference_perplexity=float(np.exp(s[3] / n)))
            for name, s in sums.items()}
