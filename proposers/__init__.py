"""Draft methods, one file each (`registry` builds one from a speculative config). Every proposer
is a frozen (hashable, jit-static) dataclass meeting `Proposer`: three pure methods, all run
inside the jitted speculative step:

    init_state(model, draft, tokens, lengths, target, choose) -> state
        after prefill: tokens [B, L] buffer, lengths [B], target: the prompt's `ForwardOut`
        (post-norm hidden [B, T, H], and the layer taps the proposer's `taps` field asks for).
    propose(model, draft, state, tokens, lengths, choose) -> (drafts [B, k], n_draft [B], q | None, state)
        q [B, k, V] are the draft probabilities when drafting is probabilistic, else None
        (the verifier then treats q as one-hot on the drafted token).
    update(model, draft, state, target, emitted, n_acc, lengths, choose) -> state
        after verification: target: the verify pass's `ForwardOut` over [newest, d1..dk],
        emitted [B, k+1] the row's new tokens (first n_acc + 1 valid), lengths [B] before them.

`model` is the target; `draft` is the method's own network (None for methods without one).
`choose(logits [B, V], positions [B]) -> (tokens [B], q [B, V] | None)` is the engine's drafting
policy (argmax, or a draw from the row's sampling distribution), so proposers never see it.
A proposer's own state rolls back the same way the target's does: by row length.

A proposer from outside this package runs through the speculative config's `proposer` field
(a Python dict only), in place of the method's own: `{"method": "custom_class",
"num_speculative_tokens": k, "proposer": obj}` (or another method, whose drafter network the
engine then loads and hands it as `draft`). `protocol_gaps` names what such an object lacks.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax

Choose = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array | None]]


class Proposer(Protocol):
    """What the engine's speculative step calls (see above for shapes). Optional attributes:
    `taps` (target layers whose outputs `ForwardOut.taps` carries), `may_not_draft` (a step
    can come up with no draft in any row, so the step compiles a one-token branch too),
    `with_drafts(n) -> Proposer` (the proposer that drafts only the first n of this one's drafts,
    from the same state, so a step that verifies fewer drafts pays only for those), `must_propose`
    (its state advances in `propose`, so even a step that verifies no draft proposes) and
    `retire(state, tokens [B, L], prompt_lengths [B], lengths [B], finished [B]) -> state` (the
    step calls it with the rows that finished in it: the suffix method caches their outputs)."""

    k: int

    def init_state(self, model, draft, tokens: jax.Array, lengths: jax.Array, target, choose: Choose) -> Any: ...

    def propose(self, model, draft, state: Any, tokens: jax.Array, lengths: jax.Array,
                choose: Choose) -> tuple[jax.Array, jax.Array, jax.Array | None, Any]: ...

    def update(self, model, draft, state: Any, target, emitted: jax.Array, n_acc: jax.Array, lengths: jax.Array,
               choose: Choose) -> Any: ...


PROTOCOL_METHODS = ("init_state", "propose", "update")


def protocol_gaps(obj: Any) -> list[str]:
    """What `obj` lacks to run as a `Proposer`: each missing method, an integer `k` if it has none,
    and "__hash__" if it cannot be hashed (the compiled programs are keyed by it). Empty: none."""
    gaps = [name for name in PROTOCOL_METHODS if not callable(getattr(obj, name, None))]
    k = getattr(obj, "k", None)
    if isinstance(k, bool) or not isinstance(k, int):
        gaps.append("k")
    try:
        hash(obj)
    except TypeError:
        gaps.append("__hash__")
    return gaps


class Shared:
    """Base of a proposer's state that every row of a batch shares (no batch axis: the suffix
    method's cache of finished outputs). Inserting a row into a batch keeps the batch's; the
    engine hands it from one batch to the next."""
