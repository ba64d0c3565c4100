"""Tensor parallelism past the head counts, on eight CPU devices: a checkpoint with two KV heads
and two GDN key heads split over 2, 4 and 8 devices (4 and 8 copy each head, as vLLM replicates
KV heads), dense and MoE, plain and with MTP, against the same checkpoint on one device. Run by
test_head_copies.py in a process started with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import FIXED_K, TINY, relative_error

from spec_jax import LLM, SamplingParams
from spec_jax.loading import load_model
from spec_jax.writing.random_checkpoint import write_checkpoint

# Two KV heads and two GDN key heads; eight query and value heads, so 8 devices divide them.
DENSE = dataclasses.replace(TINY, num_attention_heads=8, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=8)
MOE = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24)
IDS = np.arange(3, 40)
ARGS = dict(dtype="float32", max_model_len=128, max_num_seqs=2, batch_buckets=[2])
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 7], [11, 2, 30]]
MTP = {"method": "mtp", "num_speculative_tokens": 2, **FIXED_K}


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: write_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=3)
            for name, cfg in (("dense", DENSE), ("moe", MOE))}


@pytest.fixture(scope="module")
def one_device(checkpoints):
    """Per checkpoint: its logits of IDS and its greedy tokens on one device."""
    out = {}
    for name, d in checkpoints.items():
        llm = LLM(str(d), **ARGS)
        out[name] = (llm.engine.logits(IDS), tokens(llm))
    return out


def test_eight_devices_are_here():
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_n_devices_past_the_heads_equal_one_device_plain_and_with_mtp(checkpoints, one_device, name, n):
    logits, greedy = one_device[name]
    llm = LLM(str(checkpoints[name]), tensor_parallel_size=n, **ARGS)
    assert (llm.cfg.num_key_value_heads, llm.cfg.linear_num_key_heads) == (max(2, n), max(2, n))
    k = llm.model.layers[3].self_attn.k_proj.weight[...]  # each device one whole KV head (a copy past 2)
    assert {s.data.shape[1] for s in k.addressable_shards} == {max(2, n) * DENSE.head_dim // n}
    assert relative_error(llm.engine.logits(IDS), logits) < 1e-5
    assert tokens(llm) == greedy
    mtp = llm.with_speculation(MTP)
    assert tokens(mtp) == greedy
    assert mtp.metrics["num_draft_tokens"] > 0


def test_a_model_in_memory_copies_its_heads_too(checkpoints, one_device):
    model, cfg = load_model(checkpoints["dense"], "float32")
    llm = LLM(model, tensor_parallel_size=8, **ARGS)
    assert llm.cfg.num_key_value_heads == 8 and cfg.num_key_value_heads == 2
    assert relative_error(llm.engine.logits(IDS), one_device["dense"][0]) < 1e-5
