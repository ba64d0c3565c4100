"""N-gram (prompt-lookup) proposer against a plain-Python statement of vLLM's rule."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from proposers.ngram import ngram_propose


def reference(row, k, n_min, n_max):
    """Longest n in [n_min, n_max] whose suffix occurs earlier; earliest such start; drafts cut at the end."""
    length = len(row)
    for n in range(n_max, n_min - 1, -1):
        suffix = row[length - n :] if n <= length else None
        for i in range(length - n):  # i + n < length: an earlier occurrence, not the suffix itself
            if row[i : i + n] == suffix:
                return row[i + n : i + n + k]
    return []


def run(rows, k, n_min, n_max, *, L=None, pad=-1, jit=True):
    """Pack rows into [B, L] (padding = `pad`, or random garbage per row if pad is a list)."""
    L = L or max(len(r) for r in rows)
    tokens = np.zeros((len(rows), L), np.int32)
    for b, r in enumerate(rows):
        tail = pad[b] if isinstance(pad, list) else [pad] * (L - len(r))
        tokens[b] = list(r) + list(tail)[: L - len(r)]
    fn = functools.partial(ngram_propose, k=k, n_min=n_min, n_max=n_max)
    fn = jax.jit(fn) if jit else fn
    drafts, n_draft = fn(jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32))
    assert drafts.shape == (len(rows), k) and drafts.dtype == jnp.int32
    assert n_draft.shape == (len(rows),) and n_draft.dtype == jnp.int32
    drafts, n_draft = np.asarray(drafts), np.asarray(n_draft)
    assert (drafts[np.arange(k)[None, :] >= n_draft[:, None]] == 0).all(), "slots past n_draft must be 0"
    return [drafts[b, : n_draft[b]].tolist() for b in range(len(rows))]


def one(row, k, n_min, n_max, **kw):
    return run([row], k, n_min, n_max, **kw)[0]


def test_vllm_docstring_example():
    assert reference([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]
    assert one([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]
    assert one([1, 2, 3, 4, 2, 3], 4, 2, 3, jit=False) == [4, 2, 3]


def test_no_match():
    assert one([1, 2, 3, 4, 5, 6], 4, 1, 3) == []
    # [5, 6] recurs but only as a 2-gram, below n_min = 3
    assert one([5, 6, 1, 5, 6], 4, 3, 4) == []


def test_context_shorter_than_n_min():
    assert one([7], 3, 1, 2) == []
    assert one([7, 7], 3, 3, 4) == []
    assert one([7, 7, 7], 3, 3, 4) == []  # length == n_min: the suffix has nothing earlier
    assert one([7, 7, 7, 7], 3, 3, 4) == [7]  # length n_min + 1: overlapping occurrence at 0


def test_earliest_occurrence_wins():
    row = [1, 2, 8, 1, 2, 9, 1, 2, 7, 1, 2]
    assert reference(row, 2, 2, 2) == [8, 1]
    assert one(row, 2, 2, 2) == [8, 1]


def test_longest_n_beats_earlier_shorter_match():
    # [3, 1, 2] only occurs at 6 (followed by 5); [1, 2] alone occurs first at 0 (followed by 4)
    row = [1, 2, 4, 0, 0, 0, 3, 1, 2, 5, 6, 3, 1, 2]
    assert reference(row, 3, 2, 3) == [5, 6, 3]
    assert one(row, 3, 2, 3) == [5, 6, 3]
    assert one(row, 3, 2, 2) == [4, 0, 0]  # capped at n_max = 2 the earlier 2-gram wins


def test_truncated_at_row_end():
    assert one([9, 1, 2, 1, 2], 5, 2, 2) == [1, 2]
    assert one([4, 4, 4, 4, 4], 8, 1, 1) == [4, 4, 4, 4]
    assert one([4, 4, 4, 4, 4], 8, 4, 4) == [4]


def test_padding_is_never_read():
    # Padding continues the pattern: it would give a longer match / more drafts if it were read.
    row = [5, 1, 2, 3, 6, 1, 2, 3]
    assert one(row, 4, 1, 4, L=16, pad=[[5, 1, 2, 3, 6, 6, 6, 6]]) == [6, 1, 2, 3]
    # The only "occurrence" of the suffix [2, 3] lies in the padding.
    assert one([1, 2, 3], 4, 2, 2, L=12, pad=[[2, 3, 9, 9, 2, 3, 9, 9, 2]]) == []
    # A match ending just before the suffix proposes only in-context tokens.
    assert one([1, 1], 4, 1, 1, L=8, pad=1) == [1]


def test_batch_with_different_lengths():
    rows = [
        [1, 2, 3, 4, 2, 3],
        [7],
        [1, 2, 8, 1, 2, 9, 1, 2, 7, 1, 2],
        [1, 2, 3, 4, 5],
        [4, 4, 4, 4, 4],
        [3, 1, 2, 3, 1, 2, 3],
    ]
    rng = np.random.default_rng(0)
    L = 14
    garbage = [rng.integers(0, 10, L).tolist() for _ in rows]
    got = run(rows, 4, 1, 3, L=L, pad=garbage)
    assert got == [reference(r, 4, 1, 3) for r in rows]
    assert got[0] == [4, 2, 3] and got[1] == [] and got[3] == []


@pytest.mark.parametrize("k,n_min,n_max", [(1, 1, 1), (3, 1, 4), (4, 2, 3), (5, 3, 5), (8, 2, 2)])
def test_random_against_reference(k, n_min, n_max):
    rng = np.random.default_rng(1000 * k + 10 * n_min + n_max)
    B, L, vocab = 40, 32, 4
    lengths = rng.integers(1, L + 1, B)
    tokens = rng.integers(0, vocab, (B, L))  # beyond each length: random garbage from the same vocab
    rows = [tokens[b, : lengths[b]].tolist() for b in range(B)]
    garbage = [tokens[b, lengths[b] :].tolist() for b in range(B)]
    got = run(rows, k, n_min, n_max, L=L, pad=garbage)
    want = [reference(r, k, n_min, n_max) for r in rows]
    assert got == want
    assert sum(len(w) > 0 for w in want) >= B // 8  # the small vocab makes matches common
