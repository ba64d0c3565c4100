"""Structured output after the reasoning (`reasoning_grammar`, `GrammarRows` with a reasoning
parser), on llguidance matchers over small tokenizers: the reasoning before the first `</think>`
is free, the request's grammar holds from there (every constraint kind), a prompt that closed the
reasoning gets the grammar from the first token, one without a tag lets the model open a block
itself, and a tag that is a token of its own (llguidance holds `<...>` added tokens as special) is named as one."""

import json

import llguidance
import numpy as np
import pytest
from tokenizers import AddedToken

from spec_jax.default_model import train_tokenizer
from spec_jax.engine.grammar_rows import GrammarRows, special_texts
from spec_jax.engine.reasoning_grammar import after_reasoning, reasoning_start
from spec_jax.engine.structured import StructuredOutputsParams, grammar_text

VOCAB, EOS = 512, 0
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
KINDS = {"json": StructuredOutputsParams(json=CITY), "regex": StructuredOutputsParams(regex=r"[a-z]+ [0-9]{2}"),
         "choice": StructuredOutputsParams(choice=["yes", "no"]),
         "grammar": StructuredOutputsParams(grammar='start: "A" ("," "A")*'),
         "tight json": StructuredOutputsParams(json=CITY, disable_any_whitespace=True)}
ANSWERS = {"json": '{"city": "Rome"}', "regex": "abc 42", "choice": "no", "grammar": "A,A",
           "tight json": '{"city":"Paris"}'}


def tokenizer(tags: bool):
    """A byte-level BPE, with the tags as added tokens (as Qwen's: llguidance holds them as special
    tokens, their `<...>` shape says so) or only spelled in its text pieces."""
    tok = train_tokenizer(300, texts=['What is the weather in Paris? {"city": "Rome"} yes no 42. ' * 20],
                          specials=("<|im_end|>",))
    if tags:
        tok.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    return tok


@pytest.fixture(scope="module", params=[True, False], ids=["tag-tokens", "spelled-tags"])
def tok(request):
    return tokenizer(request.param)


def ids_of(tok, *pieces: str) -> list[int]:
    """Token ids of the pieces, each a tag's single token or text encoded on its own."""
    out = []
    for piece in pieces:
        tag = tok.token_to_id(piece) if piece in ("<think>", "</think>") else None
        out += [tag] if tag is not None else tok.encode(piece).ids
    return out


def matcher(tok, params, start):
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=EOS)
    special = special_texts(tok.to_str(), lt)
    assert ("</think>" in special) == (tok.token_to_id("</think>") is not None)
    m = llguidance.LLMatcher(lt, after_reasoning(grammar_text(params), start, special), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(tok, params, start, *pieces) -> bool:
    """Whether the output of these pieces, then EOS, is whole under the wrapped grammar."""
    m = matcher(tok, params, start)
    return m.consume_tokens(ids_of(tok, *pieces)) and m.is_accepting() and m.consume_token(EOS)


def test_where_the_prompt_leaves_the_output():
    assert reasoning_start("<|im_start|>assistant\n<think>\n") == "open"
    assert reasoning_start("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert reasoning_start("old turn <think>a</think> b<|im_start|>assistant\n<think>\n") == "open"
    assert reasoning_start("<|im_start|>assistant\n") == "absent"
    assert after_reasoning("start: /a/", "closed") == "start: /a/"
    with pytest.raises(ValueError, match="'ajar'; expected one of open, closed, absent"):
        after_reasoning("start: /a/", "ajar")


@pytest.mark.parametrize("kind", KINDS)
def test_the_reasoning_is_free_and_the_answer_is_held_to_the_grammar(tok, kind):
    params, answer = KINDS[kind], ANSWERS[kind]
    thought = 'I think {"city": no, yes 42 </thin'  # grammar-breaking text, a partial tag among it
    assert accepts(tok, params, "open", thought, "</think>", "\n\n", answer)
    assert accepts(tok, params, "open", "</think>", answer)  # an empty thought, no newlines
    assert not accepts(tok, params, "open", "Hm.", "</think>", "\n\n", "maybe")  # the answer breaks the grammar
    assert not accepts(tok, params, "open", "Hm.", "</think>", "\n\n", answer, "</think>")
    if tok.token_to_id("</think>") is not None:  # the tag is a token: its text spelled out ends nothing
        assert not accepts(tok, params, "open", "Hm. </", "think", ">", answer)
    m = matcher(tok, params, "open")  # EOS before the answer is whole is forbidden
    assert m.consume_tokens(ids_of(tok, "Hm.")) and not m.is_accepting()
    assert not m.consume_token(EOS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_prompt_holds_from_the_first_token_and_an_untagged_one_may_open_a_block(tok, kind):
    params, answer = KINDS[kind], ANSWERS[kind]
    assert accepts(tok, params, "closed", answer)
    assert not accepts(tok, params, "closed", "<think>", "Hm.", "</think>", "\n\n", answer)
    assert not accepts(tok, params, "closed", "Hm.", "</think>", answer)
    assert accepts(tok, params, "absent", answer)
    assert accepts(tok, params, "absent", "<think>", "\nHm.\n", "</think>", "\n\n", answer)
    assert not accepts(tok, params, "absent", "Hm.", "</think>", answer)  # no block without its opening tag


def test_grammar_rows_read_the_start_from_the_prompt_and_cache_each_form():
    tok = tokenizer(tags=True)
    rows = GrammarRows(tok.to_str(), VOCAB, EOS, reasoning_parser="qwen3")
    plain = GrammarRows(tok.to_str(), VOCAB, EOS)
    prompt = ids_of(tok, "Q?", "<think>", "\n")
    assert rows.start_after(prompt) == "open" and plain.start_after(prompt) == "closed"
    assert rows.start_after(ids_of(tok, "Q?", "<think>", "\n\n", "</think>", "\n\n")) == "closed"
    assert rows.start_after(ids_of(tok, "Q?")) == "absent"
    params = KINDS["tight json"]
    for _ in range(2):
        ids = [rows.add(params, prompt), plain.add(params, prompt)]
    assert rows.compiles == plain.compiles == 1  # each form compiled once
    first = ids_of(tok, "Hm.")[0]
    reasoning_row, plain_row = rows.rows[ids[0]].matcher, plain.rows[ids[1]].matcher
    assert reasoning_row.try_consume_tokens([first]) == 1  # the reasoning is free ...
    assert plain_row.try_consume_tokens([first]) == 0  # ... where the plain grammar wants JSON
    # after </think>: the plain grammar's first tokens, the newlines that may frame the block, and
    # shorter starts of the forced `{"` (the plain grammar, at the output's start, takes the whole)
    after, first = allowed_after(rows, ids[0], ids_of(tok, "Hm.", "</think>")), allowed_after(plain, ids[1], [])
    assert [tok.decode([t]) for t in first] == ['{"']
    assert set(first) < set(after) and {tok.decode([t]) for t in set(after) - set(first)} <= {"\n", "\n\n", "{"}


def allowed_after(rows: GrammarRows, row: int, tokens: list[int]) -> np.ndarray:
    m = rows.rows[row].matcher.deep_copy()
    assert m.consume_tokens(tokens)
    return np.flatnonzero(np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:VOCAB])


def test_a_grammar_given_as_a_list_of_grammars_keeps_its_parts_and_names():
    tok = tokenizer(tags=False)
    nested = json.dumps({"grammars": [{"name": "top", "lark_grammar": "start: \"N=\" @num"},
                                      {"name": "num", "lark_grammar": "start: /[0-9]+/"}], "max_tokens": 50})
    wrapped = json.loads(after_reasoning(nested, "open"))
    assert [g.get("name") for g in wrapped["grammars"]] == [None, "top", "num"] and wrapped["max_tokens"] == 50
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=EOS)
    m = llguidance.LLMatcher(lt, json.dumps(wrapped), log_level=0)
    assert m.consume_tokens(ids_of(tok, "Hm.", "</think>", "\n\n", "N=42")) and m.is_accepting()
