"""Both paged decode kernels at page sizes 32 and 64 (the sweeps use 16), interpret mode,
NaN in every slot past a sequence's length, ragged lengths around page boundaries."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.gpu import paged_decode_attention_gpu
from pallas_kernels.paged_attention.reference import paged_decode_attention_reference
from pallas_kernels.paged_attention.tpu import paged_decode_attention_tpu
from tests.helpers import assert_close


def _case(page, t, *, k=2, g=4, h=64, pages_per_seq=3, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [1, page - 1, page, page + 1, pages_per_seq * page]
    b = len(lengths)
    num_pages = b * pages_per_seq + 2
    table = rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq)
    k_pages = np.full((k, num_pages, page, h), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    for i, n in enumerate(lengths):
        for pos in range(n):
            k_pages[:, table[i, pos // page], pos % page] = rng.standard_normal((k, h))
            v_pages[:, table[i, pos // page], pos % page] = rng.standard_normal((k, h))
    q = rng.standard_normal((b, t, k, g, h)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32))


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("page", [32, 64])
def test_kernels_at_larger_pages(page, t):
    args = _case(page, t)
    want = paged_decode_attention_reference(*args)
    tpu = paged_decode_attention_tpu(*args, pages_per_block=2, interpret=True)
    gpu = paged_decode_attention_gpu(*args, pages_per_split=2, interpret=True)
    for out in (tpu, gpu):
        assert np.isfinite(np.asarray(out)).all()
        assert_close(out, want)
