"""Bad input is refused with an error that names the value."""

import json
import shutil

import jax
import numpy as np
import pytest
from helpers import TINY
from safetensors.numpy import load_file, save_file

from spec_jax import LLM, SamplingParams
from spec_jax.loading import load_model
from spec_jax.loading.source import CheckpointError


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(ValueError, match=r"has 256 tokens but max_model_len is 256"):
        tiny_llm.generate(prompt_token_ids=[[1] * 256])


def test_empty_prompt(tiny_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate(prompt_token_ids=[[]])


def test_token_id_outside_vocabulary(tiny_llm):
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        tiny_llm.generate(prompt_token_ids=[[1, 512]])
    with pytest.raises(ValueError, match="token id -1"):
        tiny_llm.logits([-1, 2])
    with pytest.raises(ValueError, match=f"token id {2**70} outside"):
        tiny_llm.generate(prompt_token_ids=[[1, 2**70]])


def test_compiler_options_xla_does_not_know(tiny_dir):
    with pytest.raises(ValueError, match=r"compiler_options=\{'xla_bogus': 1\}: XLA refused .*No such compile option"):
        LLM(str(tiny_dir), compiler_options={"xla_bogus": 1})
    with pytest.raises(ValueError, match="compiler_options must be a dict"):
        LLM(str(tiny_dir), compiler_options="xla_backend_optimization_level=2")


@pytest.mark.parametrize("bad", [0, -3])
def test_max_tokens_must_be_positive(bad):
    with pytest.raises(ValueError, match=f"max_tokens={bad}"):
        SamplingParams(max_tokens=bad)


@pytest.mark.parametrize("kwargs, name", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                          ({"top_k": -2}, "top_k"), ({"n": 0}, "n=0")])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_unknown_dtype(tiny_dir):
    with pytest.raises(ValueError, match="unknown dtype 'float16'; expected one of float32, bfloat16"):
        LLM(model=str(tiny_dir), dtype="float16")


def test_text_prompt_without_tokenizer(tiny_llm):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        tiny_llm.generate(["hello"])


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.language_model.layers.5.linear_attn.dt_bias"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.5.linear_attn.dt_bias'"):
        load_model(d)


def test_wrong_shape_is_named(tiny_dir, tmp_path):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.language_model.layers.3.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.3.self_attn.k_proj.weight' has shape \(8, 64\), "
                                              r"expected \(64, 64\)"):
        load_model(d)


def test_unsupported_model_type(tiny_dir, tmp_path):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_model(d)


def test_malformed_config_json(tiny_dir, tmp_path):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(d)


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_unknown_rollback(tiny_dir):
    with pytest.raises(ValueError, match="rollback='undo'; expected one of checkpoint, replay"):
        LLM(model=str(tiny_dir), rollback="undo")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
    ({"temperature": float("inf")}, "temperature=inf must be >= 0"),
    ({"top_p": float("nan")}, "top_p=nan"),
    ({"top_k": 2**40}, "top_k=1099511627776"),
    ({"top_k": True}, "top_k must be an integer"),
    ({"seed": 2**70}, "seed=1180591620717411303424 must fit in 64 bits"),
    ({"stop_token_ids": [2**40]}, r"stop_token_ids\[0\]=1099511627776 must be a token id"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
])
def test_sampling_params_are_typed_and_bounded(kwargs, message):
    """Nothing is coerced: a wrong type or an out-of-range value (one that would overflow int32
    on the device) is refused with the field's name."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


NOT_IDS = [
    ([[1.5, 2.7]], r"prompt_token_ids\[0\] has 1.5 \(float\) where a token id"),
    ([[True, 2]], r"prompt_token_ids\[0\] has True"),
    ([[0, 1, 5, False]], r"prompt_token_ids\[0\] has False \(bool\)"),
    ([[2, np.True_]], r"prompt_token_ids\[0\] has np.True_ \(bool\)"),
    ([[2, np.float32(3)]], r"prompt_token_ids\[0\] has np.float32\(3.0\) \(float32\)"),
]


@pytest.mark.parametrize("prompts, message", [
    *NOT_IDS, ("123", "prompt_token_ids must be a list of token-id lists, got '123'")])
def test_prompt_token_ids_are_not_coerced(tiny_llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(prompt_token_ids=prompts)


@pytest.mark.parametrize("prompts, message", NOT_IDS)
def test_prefill_does_not_coerce_prompt_token_ids(tiny_llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.prefill(prompts)


def test_integer_ids_of_any_kind_come_back_as_plain_ints(tiny_llm):
    ids = tiny_llm.tokenize([np.int64(3), np.uint8(0), 1, np.int32(7)])
    assert ids == [3, 0, 1, 7] and {type(t) for t in ids} == {int}
    assert tiny_llm.tokenize(np.array([4, 5], np.int16)) == [4, 5]


@pytest.mark.parametrize("kwargs, message", [({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
                                             ({"max_model_len": 0}, "max_model_len=0 must be from 2 to"),
                                             ({"seed": "1"}, "seed must be an integer")])
def test_llm_arguments_are_checked(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_dir), dtype="float32", **kwargs)


def test_seeds_past_32_bits_draw_differently():
    from spec_jax.engine.batch import seed_key

    keys = [np.asarray(jax.random.key_data(seed_key(s))) for s in (0, 2**62, 2**32, -5)]
    assert len({k.tobytes() for k in keys}) == 4
    np.testing.assert_array_equal(keys[0], np.asarray(jax.random.key_data(jax.random.key(0))))  # small seeds as before


def test_a_batch_keys_made_on_the_host_equal_each_seeds_key():
    from spec_jax.engine.batch import row_keys, seed_key

    seeds = [0, 7, 2**31 + 3, 2**32 - 1, 2**32, 2**62 + 11, -5]
    got = np.asarray(jax.random.key_data(row_keys(seeds, len(seeds) + 2)))
    want = [jax.random.key_data(seed_key(s)) for s in seeds] + [jax.random.key_data(jax.random.key(0))] * 2
    np.testing.assert_array_equal(got, np.stack(want))


def test_k_and_lookup_window_stay_below_max_model_len(tiny_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens=20 leaves no room in max_model_len=16"):
        LLM(model=str(tiny_dir), dtype="float32", max_model_len=16,
            speculative_config={"method": "mtp", "num_speculative_tokens": 20})
    with pytest.raises(ValueError, match="prompt_lookup_max=40 must be below max_model_len=16"):
        LLM(model=str(tiny_dir), dtype="float32", max_model_len=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 40})


def test_mtp_layers_are_inferred_from_the_tensors(tiny_dir, tmp_path):
    """A config.json without mtp_num_hidden_layers, over a checkpoint that holds mtp.* tensors,
    still loads the head (as the GGUF loader infers it from nextn)."""
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    config = json.loads((d / "config.json").read_text())
    text = config.get("text_config", config)
    assert text.pop("mtp_num_hidden_layers") == 1
    (d / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(d)
    assert cfg.mtp_num_hidden_layers == 1 and model.mtp is not None


def rewrite_config(d, edit):
    config = json.loads((d / "config.json").read_text())
    edit(config.get("text_config", config))
    (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", -1, "hidden_size=-1 must be an integer >= 1"),
    ("hidden_size", "384", "hidden_size='384' must be an integer"),
    ("hidden_size", 384.5, "hidden_size=384.5 must be an integer"),
    ("vocab_size", -1, "vocab_size=-1"),
    ("num_key_value_heads", 0, "num_key_value_heads=0"),
    ("linear_num_key_heads", 0, "linear_num_key_heads=0"),
    ("rms_norm_eps", "x", "rms_norm_eps='x' must be a number"),
    ("rms_norm_eps", -1, "rms_norm_eps=-1"),
    ("max_position_embeddings", "2048", "max_position_embeddings='2048'"),
    ("eos_token_id", 2**40, "must be token ids"),
    ("eos_token_id", [[0]], "must be token ids"),
    ("eos_token_id", {}, "must be token ids"),
    ("hidden_act", "gelu_pytorch_tanh", "unsupported hidden_act 'gelu_pytorch_tanh'"),
    ("attn_output_gate", False, "attn_output_gate=False is not supported"),
])
def test_malformed_config_values_are_named(tiny_dir, tmp_path, key, value, message):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    rewrite_config(d, lambda text: text.update({key: value}))
    with pytest.raises(CheckpointError, match=rf"config.json: .*{message}"):
        load_model(d)


@pytest.mark.parametrize("name, content", [("config.json", "[1, 2]"), ("config.json", '"text"'),
                                           ("config.json", "null"), ("generation_config.json", "[]")])
def test_json_files_of_the_wrong_type(tiny_dir, tmp_path, name, content):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    (d / name).write_text(content)
    with pytest.raises(CheckpointError, match=rf"{name} holds a JSON \w+, where an object"):
        load_model(d)


@pytest.mark.parametrize("factor, message", [(2.0, r"partial_rotary_factor=2.0 must be a number in \(0, 1\]"),
                                             (0.3, r"= 9 dims of each head; that must be an even number"),
                                             (0.01, r"= 0 dims of each head")])
def test_partial_rotary_factor_out_of_range(tiny_dir, tmp_path, factor, message):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    rewrite_config(d, lambda text: text.setdefault("rope_parameters", {}).update(partial_rotary_factor=factor))
    with pytest.raises(CheckpointError, match=message):
        load_model(d)


@pytest.mark.parametrize("bad, message", [(np.nan, "holds NaN or inf"), (np.inf, "holds NaN or inf"),
                                          ("int32", "is int32; a weight is stored as a float"),
                                          ("float64", "is float64")])
def test_corrupt_or_foreign_weights_are_refused(tiny_dir, tmp_path, bad, message):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.language_model.layers.1.mlp.up_proj.weight"
    if isinstance(bad, str):
        tensors[name] = tensors[name].astype(bad)
    else:
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = bad
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"'model.layers.1.mlp.up_proj.weight' {message}"):
        load_model(d)


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", 7, None])
def test_index_shards_stay_inside_the_model_directory(tiny_dir, tmp_path, shard):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    names = list(load_file(str(d / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names} | {names[0]: shard}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="a shard is a file name inside"):
        load_model(d)


def test_a_hub_snapshot_with_symlinked_shards_loads(tiny_dir, tmp_path):
    """The HF cache's layout: a snapshot's files are symlinks into a blobs folder beside it."""
    d = copy_checkpoint(tiny_dir, tmp_path / "snapshots" / "abc")
    (tmp_path / "blobs").mkdir()
    (d / "model.safetensors").rename(tmp_path / "blobs" / "f00d")
    (d / "model.safetensors").symlink_to("../../blobs/f00d")
    names = list(load_file(str(d / "model.safetensors")))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    model, _ = load_model(d)
    want, _ = load_model(tiny_dir)
    np.testing.assert_array_equal(np.asarray(model.embed_tokens[...]), np.asarray(want.embed_tokens[...]))


def test_a_model_path_that_is_a_file_is_named(tiny_dir):
    with pytest.raises(CheckpointError, match="is a file: pass the folder"):
        load_model(tiny_dir / "config.json")


def test_a_draft_model_that_is_a_file_is_named(tiny_dir, tmp_path):
    f = tmp_path / "draft.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="speculative_config.model='.*draft.bin' is not a folder; method 'draft_model' "
                                         "needs the drafter's checkpoint folder"):
        LLM(model=str(tiny_dir), dtype="float32", max_model_len=64,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(f)})


def test_generation_config_values_are_checked_at_load(tiny_dir, tmp_path):
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    (d / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="generation_config.json: temperature must be a number, got 'hot'"):
        LLM(model=str(d), dtype="float32", max_model_len=64)


@pytest.mark.parametrize("sampling_params", [{"max_tokens": 4}, [{"max_tokens": 4}], 4, "x"])
def test_sampling_params_of_the_wrong_type_are_named(tiny_llm, sampling_params):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of one per prompt"):
        tiny_llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sampling_params, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        tiny_llm.prefill([[5, 6, 7]], sampling_params)


def test_prefill_and_generate_stream_check_params_against_the_model(tiny_llm):
    bad = SamplingParams(logit_bias={TINY.vocab_size: 1.0})
    with pytest.raises(ValueError, match="logit_bias has token id .* outside the vocabulary"):
        tiny_llm.prefill([[5, 6]], bad)
    with pytest.raises(ValueError, match="logit_bias has token id .* outside the vocabulary"):
        next(tiny_llm.generate_stream(prompt_token_ids=[5, 6], sampling_params=bad))
    with pytest.raises(ValueError, match="min_tokens=1000 exceeds max_model_len=256"):
        tiny_llm.prefill([[5, 6]], SamplingParams(min_tokens=1000, max_tokens=None))


def test_token_id_arrays_of_python_objects_or_no_axis(tiny_llm):
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    want = tiny_llm.generate(prompt_token_ids=[[5, 6]], sampling_params=greedy, use_tqdm=False)[0].outputs[0]
    got = tiny_llm.generate(prompt_token_ids=[np.array([5, 6], dtype=object)], sampling_params=greedy,
                            use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] must be a list of token ids, got 5"):
        tiny_llm.generate(prompt_token_ids=[np.array(5)], use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(chat_template="/nonexistent/t.jinja"), "is no file and no Jinja source"),
    (dict(chat_template=5), "chat_template must be Jinja source text or a file"),
    (dict(chat_template="{{ messages[0].content }}", chat_template_kwargs=[1]), "chat_template_kwargs must be a dict"),
])
def test_chat_template_arguments_are_checked(tiny_llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), **kwargs)


def test_a_chat_template_that_is_not_text_is_named(tiny_dir, tmp_path):
    from spec_jax.api.chat import read_chat_template

    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ValueError, match="chat_template is a int; it must be Jinja source text"):
        read_chat_template(d)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=1.0), "tensor_parallel_size=1.0 must be an integer"),
    (dict(prefix_cache_host_gb=True, enable_prefix_caching=True), "prefix_cache_host_gb=True must be a number"),
    (dict(max_model_len=10**12), "max_model_len=1000000000000 must be from 2 to 2147483647"),
])
def test_llm_arguments_of_the_wrong_kind_are_named(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_dir), dtype="float32", **({"max_model_len": 64} | kwargs))


def test_decode_steps_and_state_are_checked(tiny_llm):
    state = tiny_llm.prefill([[5, 6]], SamplingParams(max_tokens=4))
    for steps, message in (("3", "steps must be an integer"), (1.5, "steps must be an integer"),
                           (2**40, "steps=1099511627776 must be a positive number of steps")):
        with pytest.raises(ValueError, match=message):
            tiny_llm.decode(state, steps)
    with pytest.raises(ValueError, match="state must be the DecodeState"):
        tiny_llm.decode(None)


def test_a_logit_bias_key_of_non_ascii_digits_is_named():
    with pytest.raises(ValueError, match="logit_bias key '²' must be a token id"):
        SamplingParams(logit_bias={"²": 1.0})


@pytest.mark.parametrize("kwargs, message", [(dict(model=123), "model must be a path or a Hugging Face repo id"),
                                             (dict(model=["a"]), "model must be a path"),
                                             (dict(tokenizer="/nonexistent/tok.json"),
                                              "tokenizer '/nonexistent/tok.json' does not exist")])
def test_model_and_tokenizer_paths_are_named(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 64} | kwargs))


def test_tensors_a_config_leaves_unread_are_named(tiny_dir, tmp_path, caplog):
    """config.json describing fewer layers than the checkpoint holds loads, with a warning naming
    the tensors left unread; a whole checkpoint loads without one."""
    with caplog.at_level("WARNING", logger="spec_jax"):
        load_model(tiny_dir)
    assert "not used by the model" not in caplog.text
    d = copy_checkpoint(tiny_dir, tmp_path / "ckpt")
    half = TINY.num_hidden_layers // 2
    rewrite_config(d, lambda text: text.update(num_hidden_layers=half, layer_types=text["layer_types"][:half]))
    with caplog.at_level("WARNING", logger="spec_jax"):
        load_model(d)
    assert "tensors of the checkpoint are not used by the model" in caplog.text
    assert f"model.layers.{half}." in caplog.text or f"model.layers.{half + 1}." in caplog.text
