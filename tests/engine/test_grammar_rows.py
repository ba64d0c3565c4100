"""The host side of structured output (`GrammarRows.step`), with the default model's tokenizer: drafts
the grammar forbids are cut, forced tokens are drafted, each position's mask is the grammar's after
the drafts before it, matchers advance over written tokens only, grammars compile once."""

import llguidance
import numpy as np
import pytest

from spec_jax import default_model
from spec_jax.engine.grammar_rows import GrammarRows
from spec_jax.engine.structured import StructuredOutputsParams, grammar_text
from spec_jax.loading.tokenizer import Tokenizer

VOCAB = 8192
SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                       "required": ["name"], "additionalProperties": False},
                                 disable_any_whitespace=True)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model.ASSETS / "tokenizer.json")


@pytest.fixture
def rows(tokenizer):
    return GrammarRows(tokenizer.hf.to_str(), VOCAB, eos=0)


def allowed(mask_words: np.ndarray) -> np.ndarray:
    """Token ids a bitmask [W] allows."""
    return np.flatnonzero(np.unpackbits(mask_words.view(np.uint8), bitorder="little")[:VOCAB])


def reference_mask(rows: GrammarRows, params, consumed: list[int]) -> np.ndarray:
    """The allowed ids after `consumed`, from a matcher of its own."""
    matcher = llguidance.LLMatcher(rows.tokenizer, grammar_text(params))
    assert matcher.consume_tokens(consumed)
    return allowed(np.frombuffer(matcher.compute_bitmask(), np.int32))


def call(rows, ids, lengths, recent, drafts, n_draft, limit):
    """One step's grammar work as the compiled step does it: `begin`, then `finish` -> (masks,
    drafts, n_draft), a row whose grammar failed verifying none."""
    ticket, drafts, n_draft = rows.begin(*(np.asarray(x, np.int32) for x in (ids, lengths, recent, drafts, n_draft,
                                                                             limit)))
    masks, failed = rows.finish(ticket)
    return masks, drafts, np.where(failed, 0, n_draft)


def test_forbidden_drafts_are_cut_and_forced_tokens_drafted(rows, tokenizer):
    row = rows.add(SCHEMA)
    opening = tokenizer.encode('{"name":"')
    wrong = tokenizer.encode("x")[0]
    # Row 0 is constrained, row 1 is not. Row 0's proposer drafted a token the grammar forbids.
    masks, drafts, n_draft = call(rows, [row, -1], [5, 9], np.zeros((2, 0)), [[wrong] * 3, [7, 8, 9]], [3, 2], [3, 2])
    assert drafts[0].tolist() == opening[:3] and n_draft[0] == 3  # the forced opening, in its canonical tokens
    assert drafts[1].tolist() == [7, 8, 9] and n_draft[1] == 2  # an unconstrained row's drafts stay
    for j in range(4):
        assert allowed(masks[0, j]).tolist() == reference_mask(rows, SCHEMA, opening[:j]).tolist()
        assert len(allowed(masks[1, j])) == VOCAB  # all ones
    # Write the opening and a name, at most 4 tokens a step (k + 1 with k = 3).
    length = 5
    for start in range(0, len(written := opening + tokenizer.encode("Ada")), 4):
        chunk = written[start:start + 4]
        length += len(chunk)
        call(rows, [row], [length], [[0] * (4 - len(chunk)) + chunk], np.zeros((1, 3)), [0], [3])
    # Inside the string nothing is forced: a forbidden draft (EOS) ends the drafts there.
    letter = tokenizer.encode("a")[0]
    _, drafts, n_draft = call(rows, [row], [length], [written[-4:]], [[letter, 0, letter]], [3], [3])
    assert drafts[0, 0] == letter and n_draft[0] == 1
    # The proposer drafts the closing quote (valid), EOS (forbidden: the object is open) and EOS:
    # the grammar puts its forced "}" in place of the first EOS, and keeps the second.
    quote, brace = tokenizer.encode('"')[0], tokenizer.encode("}")[0]
    masks, drafts, n_draft = call(rows, [row], [length], [written[-4:]], [[quote, 0, 0]], [3], [3])
    assert drafts[0].tolist() == [quote, brace, 0] and n_draft[0] == 3
    assert allowed(masks[0, 2]).tolist() == [0]  # only EOS after "}"
    # A limit of 1 (no room for more) verifies the first draft alone.
    _, _, n_draft = call(rows, [row], [length], [written[-4:]], [[quote, 0, 0]], [3], [1])
    assert n_draft[0] == 1


def test_matchers_advance_over_written_tokens_only(rows, tokenizer):
    row = rows.add(SCHEMA)
    call(rows, [row], [3], np.zeros((1, 0)), np.zeros((1, 2)), [0], [2])  # the row's first step: prompt of 3
    opening = tokenizer.encode('{"name":"')
    # The step drafted the whole opening, but only its first two tokens were written.
    masks, _, _ = call(rows, [row], [5], [[0, opening[0], opening[1]]], np.zeros((1, 2)), [0], [0])
    assert allowed(masks[0, 0]).tolist() == reference_mask(rows, SCHEMA, opening[:2]).tolist()
    with pytest.raises(RuntimeError, match="at most 3 expected"):
        call(rows, [row], [9], [[0, 0, 0]], np.zeros((1, 2)), [0], [0])


def test_a_row_writing_a_forbidden_token_is_an_error(rows, tokenizer):
    row = rows.add(SCHEMA)
    call(rows, [row], [3], np.zeros((1, 0)), np.zeros((1, 0)), [0], [0])
    with pytest.raises(RuntimeError, match="forbids"):
        call(rows, [row], [4], [[tokenizer.encode("x")[0]]], np.zeros((1, 0)), [0], [0])


def test_a_schema_compiles_once(rows):
    for _ in range(3):
        rows.add(SCHEMA)
    assert rows.compiles == 1
    rows.add(StructuredOutputsParams(json=SCHEMA.json))  # whitespace allowed: another grammar
    assert rows.compiles == 2


def test_a_grammar_that_does_not_compile_or_admits_nothing_is_named(rows):
    with pytest.raises(ValueError, match=r"the regex constraint does not compile: .*invalid regex"):
        rows.add(StructuredOutputsParams(regex="(ab"))
    with pytest.raises(ValueError, match=r"does not compile: Unsatisfiable schema: minLength \(5\) is greater"):
        rows.add(StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2}))
    # llguidance 1.6.1 builds no number for a negative range with a step: no first token, refused here
    with pytest.raises(ValueError, match=r"does not compile: NoExtensionBias"):
        rows.add(StructuredOutputsParams(json={"type": "number", "minimum": -28, "maximum": -7, "multipleOf": 0.5}))
    with pytest.raises(RuntimeError, match="grammar id 7, which no request owns"):
        call(rows, [7], [3], np.zeros((1, 0)), np.zeros((1, 0)), [0], [0])
