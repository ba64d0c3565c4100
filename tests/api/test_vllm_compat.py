"""A vLLM user's script on spec_jax: engine arguments used, ignored (said once) or refused by name;
Hugging Face repo ids from the local cache; `quantization` checked or applied on load; prompt dicts,
n completions, stop strings and stop reasons, chat, the tokenizer, generation-config defaults and
lifetime metrics under vLLM's names."""

import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import vllm_offline_script
from helpers import FIXED_K, TINY

from spec_jax import LLM, SamplingParams
from spec_jax.api import engine_args
from spec_jax.engine import core as core_module
from spec_jax.api.engine_args import check_quantization
from spec_jax.engine.metrics import Vector
from spec_jax.engine.sampling import apply_penalties
from spec_jax.default_model import train_tokenizer


def test_arguments_that_mean_nothing_here_are_accepted_and_said_once(tiny_dir, monkeypatch):
    monkeypatch.setattr(engine_args, "_said", set())
    with pytest.warns(UserWarning, match=r"enforce_eager=True is accepted .* ignored: .*ahead-of-time"):
        LLM(str(tiny_dir), enforce_eager=True, trust_remote_code=True, tensor_parallel_size=1, swap_space=4,
            kv_cache_dtype="auto", disable_log_stats=True, max_model_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second LLM says nothing again
        LLM(str(tiny_dir), enforce_eager=True, trust_remote_code=True, max_model_len=64)


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline_parallel_size": 4}, r"pipeline_parallel_size=4: pipeline parallelism is not built; .* \(use 1\)"),
    ({"data_parallel_size": 2}, r"data_parallel_size=2: data parallelism is not built"),
    ({"kv_cache_dtype": "fp8"}, r"kv_cache_dtype='fp8' is not supported; accepted: 'auto'"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be a fraction in \(0, 1\]"),
    ({"quantization": "awq"}, r"quantization='awq' is not supported; accepted: None, 'fp8', 'modelopt'"),
    ({"quantization": "modelopt"}, r"quantization='modelopt' does not match the checkpoint, which is not quantized"),
])
def test_refused_values_name_what_is_accepted(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_dir), max_model_len=64, **kwargs)


def test_an_unknown_argument_is_a_type_error(tiny_dir):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        LLM(str(tiny_dir), max_num_seq=4)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_on_load(tiny_dir):
    llm = LLM(str(tiny_dir), quantization="fp8", max_model_len=64)
    assert llm.model.layers[0].mlp.down_proj.format == "fp8"
    assert check_quantization("fp8", ("fp8",)) is None  # an FP8 checkpoint loads as stored
    assert check_quantization("modelopt_fp4", ("modelopt_fp4", "modelopt")) is None


def test_a_repo_id_resolves_to_its_snapshot_in_the_local_cache(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny-qwen"
    shutil.copytree(tiny_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    llm = LLM("acme/tiny-qwen", max_model_len=64)
    assert llm.model_path == str(repo / "snapshots" / "abc123")
    with pytest.raises(ValueError, match=r"'acme/other' is not a local path, .* not in the local cache .*download"):
        LLM("acme/other")


def test_gpu_memory_utilization_sizes_max_num_seqs(tiny_dir, monkeypatch, caplog):
    """Rows of caches that fit in the share of device memory beside the loaded weights, capped at
    max_num_seqs (vLLM's 256 when not given), and said."""
    logging.getLogger("spec_jax").addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="spec_jax")
    try:
        LLM(str(tiny_dir), max_model_len=64, gpu_memory_utilization=0.5)  # the CPU reports no limit
        assert "reports no memory limit; max_num_seqs stays 256" in caplog.text
        probe = LLM(str(tiny_dir), max_model_len=64, max_num_seqs=1)
        row = probe.engine.row_bytes()
        monkeypatch.setattr(core_module, "device_memory", lambda: {"bytes_limit": 100 * row, "bytes_in_use": 10 * row})
        llm = LLM(str(tiny_dir), max_model_len=64, gpu_memory_utilization=0.5)
        assert llm.engine.max_num_seqs == 40  # 0.5 x 100 rows - 10 in use
        assert "max_num_seqs 40 (cap 256)" in caplog.text
        assert LLM(str(tiny_dir), max_model_len=64, max_num_seqs=8, gpu_memory_utilization=0.5).engine.max_num_seqs == 8
        # The prefix cache takes what the batch leaves of the share, unless its size is given.
        cached = LLM(str(tiny_dir), max_model_len=64, max_num_seqs=8, gpu_memory_utilization=0.5,
                     enable_prefix_caching=True)
        assert cached.engine.prefix_cache.budget_bytes == 32 * row  # 50 rows' share - 10 in use - 8 rows
        assert cached.with_speculation(None).engine.prefix_cache.budget_bytes == 32 * row
        sized = LLM(str(tiny_dir), max_model_len=64, max_num_seqs=8, gpu_memory_utilization=0.5,
                    enable_prefix_caching=True, prefix_cache_gb=1.0)
        assert sized.engine.prefix_cache.budget_bytes == 10**9
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 leaves .* less than one row of caches"):
            LLM(str(tiny_dir), max_model_len=64, gpu_memory_utilization=0.1)
    finally:
        logging.getLogger("spec_jax").removeHandler(caplog.handler)


# ----------------------------------------------------------------------------- offline generation

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def chat_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with a tokenizer, a ChatML template and Qwen-style generation defaults."""
    d = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_dir, d)
    train_tokenizer(TINY.vocab_size).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    return d


@pytest.fixture(scope="module")
def chat_llm(chat_dir):
    return LLM(str(chat_dir), dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4])


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_a_vllm_script_runs_with_only_its_import_changed(chat_dir):
    source = (Path(__file__).parent / "vllm_offline_script.py").read_text()
    code = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")
            and not line.startswith(('"""', "that runs it"))]
    assert [line for line in code if "spec_jax" in line] == ["from spec_jax import LLM, SamplingParams  # was: from "
                                                             "vllm import LLM, SamplingParams"]
    out = vllm_offline_script.main(str(chat_dir))
    assert len(out["completions"]) == 4 and [c[1] for c in out["completions"]] == [0, 1, 0, 1]
    assert out["completions"][0][0] == "def add(a, b):"
    for _, _, text, ids, finish, stop in out["completions"]:
        assert finish in ("stop", "length") and ids and "\n\n" not in text
        assert (stop == "\n\n") == (finish == "stop" and stop is not None)
    assert out["chat_prompt"] == out["rendered"] == "<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\n" \
                                                    "Say hi<|im_end|>\n<|im_start|>assistant\n"
    assert len(out["by_ids"]) == 4
    assert (out["defaults"].temperature, out["defaults"].top_p, out["defaults"].top_k) == (0.6, 0.95, 20)
    assert out["counters"]["vllm:request_success"] == 4 and out["counters"]["vllm:generation_tokens"] > 0


def test_n_completions_are_rows_with_their_own_streams(chat_llm):
    ids = [[5, 6, 7]]
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=11, ignore_eos=True)
    a = chat_llm.generate(prompt_token_ids=ids, sampling_params=sampled, use_tqdm=False)[0]
    b = chat_llm.generate(prompt_token_ids=ids, sampling_params=sampled, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded: repeatable
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3  # seed + i: different samples
    one = chat_llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=1.0, max_tokens=12, seed=12, ignore_eos=True), use_tqdm=False)[0]
    assert a.outputs[1].token_ids == one.outputs[0].token_ids  # completion i is the request seeded seed + i
    greedy = chat_llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(n=2, temperature=0, max_tokens=8,
                                                                                   ignore_eos=True), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert greedy.metrics["num_generated_tokens"] == 16


def test_stop_strings_cut_the_text_and_name_themselves(chat_llm):
    prompt = "def add(a, b):"
    full = chat_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    at = full.text.find(stop)
    cut = chat_llm.generate(prompt, dataclasses.replace(GREEDY, stop=stop), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (full.text[:at], "stop", stop)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    assert chat_llm.get_tokenizer().decode(cut.token_ids).find(stop) == at  # ids end with the stop string's token
    kept = chat_llm.generate(prompt, dataclasses.replace(GREEDY, stop=[stop, "never here"],
                                                         include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == full.text[:at + len(stop)]


def test_a_stop_token_is_the_stop_reason(chat_llm):
    full = chat_llm.generate(prompt_token_ids=[[9, 8, 7]], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0]
    token = full.token_ids[2]
    first = full.token_ids.index(token)
    out = chat_llm.generate(prompt_token_ids=[[9, 8, 7]], sampling_params=dataclasses.replace(
        GREEDY, stop_token_ids=[token], ignore_eos=False), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (full.token_ids[:first + 1], "stop", token)
    plain = chat_llm.generate(prompt_token_ids=[[9, 8, 7]], sampling_params=dataclasses.replace(
        GREEDY, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert plain.text == "" and plain.token_ids == full.token_ids


def test_prompt_dicts_and_chat(chat_llm):
    text = "class Stack:"
    ids = chat_llm.get_tokenizer().encode(text)
    want = chat_llm.generate(text, GREEDY, use_tqdm=False)[0]
    for prompt in ({"prompt": text}, [{"prompt_token_ids": ids}]):
        got = chat_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.prompt_token_ids == ids
    with pytest.raises(ValueError, match=r"prompt 0: a prompt dict holds one of 'prompt' .* got keys \['text'\]"):
        chat_llm.generate({"text": text}, GREEDY)
    messages = [{"role": "user", "content": "hi"}]
    chat = chat_llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})[0]
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>"
    assert chat.prompt == rendered
    assert chat_llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                        enable_thinking=True) == rendered
    assert chat.outputs[0].token_ids == chat_llm.generate(rendered, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    two = chat_llm.chat([messages, messages], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].prompt == rendered.removesuffix("<think>")


def test_generation_config_defaults_apply_when_no_params_are_given(chat_llm):
    p = chat_llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 16)
    out = chat_llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 16


def test_get_metrics_counts_over_the_llms_lifetime(chat_dir):
    llm = LLM(str(chat_dir), dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4],
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, **FIXED_K})  # mtp_chat_llm's config
    outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=GREEDY, use_tqdm=False)
    outs += llm.generate(prompt_token_ids=[[6, 7]], sampling_params=GREEDY, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:request_success"].value == 3
    assert metrics["vllm:generation_tokens"].value == 3 * 24 and metrics["vllm:prompt_tokens"].value == 7
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    assert metrics["vllm:spec_decode_num_drafts"].value == drafts > 0
    draft_tokens = sum(o.metrics["num_draft_tokens"] for o in outs)
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == draft_tokens <= 2 * drafts
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == 2
    assert sum(per_pos.values) == metrics["vllm:spec_decode_num_accepted_tokens"].value


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 3}, r"presence_penalty=3 must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, r"repetition_penalty=0 must be > 0"),
    ({"logprobs": 25}, r"logprobs=25 must be 0 \(the sampled token's only\) to 20"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs=21 must be 0 \(each prompt token's only\) to 20"),
    ({"logits_processors": [abs]}, r"logits_processors=\[<built-in function abs>\] is not supported yet"),
    ({"n": 2, "best_of": 4}, r"best_of=4 is not supported .* ask for n=4"),
    ({"stop": ["", "x"]}, r"stop must be a non-empty string or a list of them"),
])
def test_sampling_fields_not_built_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ----------------------------------------------------------------------------- logit processors


@pytest.fixture(scope="module")
def mtp_chat_llm(chat_llm):
    return chat_llm.with_speculation({"method": "mtp", "num_speculative_tokens": 2, **FIXED_K})


def greedy_both(chat_llm, mtp_chat_llm, **fields) -> list[int]:
    """Greedy token ids with `fields` set, spec off and MTP k=2 on, asserted identical."""
    params = dataclasses.replace(GREEDY, **fields)
    ids = [[9, 8, 7], [3, 4, 5, 6, 7, 8]]
    off = [o.outputs[0].token_ids for o in chat_llm.generate(prompt_token_ids=ids, sampling_params=params,
                                                             use_tqdm=False)]
    on = [o.outputs[0].token_ids for o in mtp_chat_llm.generate(prompt_token_ids=ids, sampling_params=params,
                                                                use_tqdm=False)]
    assert on == off
    return off


def test_logit_bias_and_allowed_token_ids_hold_with_speculation(chat_llm, mtp_chat_llm):
    plain = greedy_both(chat_llm, mtp_chat_llm)
    first = plain[0][0]
    biased = greedy_both(chat_llm, mtp_chat_llm, logit_bias={first: -100.0})
    assert biased[0][0] != first and first not in biased[0]
    allowed = [1, 2, 3, 40, 41]
    for row in greedy_both(chat_llm, mtp_chat_llm, allowed_token_ids=allowed):
        assert set(row) <= set(allowed)
    with pytest.raises(ValueError, match=r"logit_bias has token id 512 outside the vocabulary \[0, 512\)"):
        chat_llm.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(logit_bias={512: 1.0}))


def test_bad_words_are_never_generated(chat_llm, mtp_chat_llm):
    tok = chat_llm.get_tokenizer()
    plain = greedy_both(chat_llm, mtp_chat_llm)
    word = next(w for w in (tok.decode([t]).strip() for t in plain[0])
                if w and len(tok.encode(w)) == 1 and len(tok.encode(" " + w)) == 1)
    banned = {tok.encode(word)[0], tok.encode(" " + word)[0]}
    for row in greedy_both(chat_llm, mtp_chat_llm, bad_words=[word]):
        assert not banned & set(row)
    with pytest.raises(ValueError, match=r"bad_words: .* is longer than 8 tokens"):
        chat_llm.generate("x", SamplingParams(bad_words=["a long phrase of many words, longer than eight tokens"]))


def contains(row: list[int], word: list[int]) -> bool:
    return any(row[i:i + len(word)] == word for i in range(len(row) - len(word) + 1))


def test_multi_token_bad_words_are_never_completed(chat_llm, mtp_chat_llm):
    """A bad word of several tokens: its last token is banned wherever the generated tokens end
    with the rest of it (vLLM's rule), with speculation on as off; drafts before a verify position
    count as generated."""
    tok = chat_llm.get_tokenizer()
    plain = greedy_both(chat_llm, mtp_chat_llm)
    for j in range(len(plain[0]) - 1):  # a word the plain output spells as two or more tokens
        word = tok.decode(plain[0][j:j + 2])
        forms = chat_llm.bad_word_forms(SamplingParams(bad_words=[word]))
        if word.strip() and any(len(f) > 1 and contains(plain[0], f) for f in forms):
            break
    else:
        pytest.fail("no two-token word in the plain output")
    banned = greedy_both(chat_llm, mtp_chat_llm, bad_words=[word])
    assert banned[0] != plain[0]
    for row in banned:
        assert not any(contains(row, f) for f in forms)


def test_min_tokens_holds_stop_tokens_back(chat_llm, mtp_chat_llm):
    plain = greedy_both(chat_llm, mtp_chat_llm)
    stop = plain[0][1]
    early = greedy_both(chat_llm, mtp_chat_llm, stop_token_ids=[stop], ignore_eos=False)
    assert early[0] == plain[0][:2]
    late = greedy_both(chat_llm, mtp_chat_llm, stop_token_ids=[stop], ignore_eos=False, min_tokens=6)
    assert len(late[0]) >= 6 and stop not in late[0][:5]
    with pytest.raises(ValueError, match="min_tokens=20 must not exceed max_tokens=10"):
        SamplingParams(min_tokens=20, max_tokens=10)


def test_min_p_keeps_sampling_exact_and_seeded(chat_llm, mtp_chat_llm):
    params = SamplingParams(temperature=1.0, min_p=0.2, max_tokens=12, seed=5, ignore_eos=True)
    ids = [[9, 8, 7]]
    a = chat_llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    b = chat_llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 12
    logits = chat_llm.logits(ids[0])[-1]
    p = np.exp(logits - logits.max())
    assert p[a[0]] >= 0.2  # the first token clears min_p x the top probability


def test_penalties_hold_with_speculation(chat_llm, mtp_chat_llm):
    """Greedy with presence, frequency and repetition penalties: spec-on equals spec-off (the verify
    pass counts the drafts before each position), and the penalties cut repetition."""
    plain = greedy_both(chat_llm, mtp_chat_llm)
    penalized = greedy_both(chat_llm, mtp_chat_llm, presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3)
    repeats = lambda rows: sum(len(r) - len(set(r)) for r in rows)  # noqa: E731
    assert penalized != plain and repeats(penalized) < repeats(plain)


def test_apply_penalties_is_vllms_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 7)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (2, 7))
    in_prompt = rng.random((2, 7)) < 0.3
    presence, frequency, repetition = np.array([0.5, -0.2]), np.array([0.3, 1.0]), np.array([1.2, 0.8])
    seen = (counts > 0) | in_prompt
    want = np.where(seen, np.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None]), logits)
    want = want - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    got = apply_penalties(jnp.asarray(logits), tuple(jnp.asarray(x, jnp.float32) for x in (presence, frequency,
                                                                                          repetition)),
                          jnp.asarray(counts), jnp.asarray(in_prompt))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_prompt_logprobs_are_the_targets_over_the_prompt(chat_llm):
    prompt = [9, 8, 7, 100, 3, 3]
    out = chat_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=2),
                            use_tqdm=False)[0]
    ref = log_softmax(chat_llm.logits(prompt))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j, entries in enumerate(out.prompt_logprobs[1:]):
        want = ref[j]
        token = prompt[j + 1]
        assert set(np.argsort(-want)[:2].tolist()) | {token} == set(entries)
        assert entries[token].rank == 1 + int(np.sum(want > want[token]))
        for t, entry in entries.items():
            assert abs(entry.logprob - want[t]) < 1e-4
            assert entry.decoded_token == chat_llm.get_tokenizer().decode([t], False)


def test_logprobs_are_the_targets_with_speculation_on_or_off(chat_llm, mtp_chat_llm):
    """vLLM's logprobs (raw target logits): each token's own entry and the top K, equal to a
    full-sequence forward's log-softmax, the same from the verify pass as from plain decoding."""
    params = dataclasses.replace(GREEDY, logprobs=3)
    prompt = [9, 8, 7]
    off = chat_llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    on = mtp_chat_llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert on.token_ids == off.token_ids and len(off.logprobs) == len(on.logprobs) == 24
    ref = log_softmax(chat_llm.logits(prompt + off.token_ids))
    for j, token in enumerate(off.token_ids):
        want = ref[len(prompt) - 1 + j]
        top = set(np.argsort(-want)[:3].tolist())
        for entries in (off.logprobs[j], on.logprobs[j]):
            assert set(entries) == top and entries[token].rank == 1  # greedy: the sampled token is the top one
            for t, entry in entries.items():
                assert abs(entry.logprob - want[t]) < 1e-4
    assert abs(off.cumulative_logprob - sum(ref[len(prompt) - 1 + j, t] for j, t in enumerate(off.token_ids))) < 1e-3
    sampled = chat_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=1.0, max_tokens=6, seed=2, logprobs=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in sampled.logprobs] == [[t] for t in sampled.token_ids]
    assert all(e[t].rank >= 1 and e[t].decoded_token == chat_llm.get_tokenizer().decode([t], False)
               for e, t in zip(sampled.logprobs, sampled.token_ids))
