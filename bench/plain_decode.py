"""Plain (non-speculative) decode throughput on a random-weight model of a real Qwen3.5 geometry.

    python bench/plain_decode.py --geometry 0.8b --batch 1 8 --new-tokens 256

Builds the checkpoint in a temp folder (random bf16 weights, released layout), loads it, runs a
greedy generation once to compile, then times a second run. Reports decode tokens/s, time per
output token and the weight bytes streamed per step over the step time (achieved GB/s; the
H200's measured HBM ceiling is about 3.45 TB/s for JAX elementwise copies, DESIGN.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from models import qwen3_5
from models.qwen3_5 import Qwen3_5Config
from pallas_kernels.quant_matmul import FORMATS
from spec_jax import LLM, SamplingParams
from spec_jax.convert import convert
from spec_jax.random_checkpoint import write_checkpoint

GEOMETRIES = {
    # qwen35_architecture.md section 1.2
    "0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True, vocab_size=4096),
}


class RolledLayers(argparse.Action):
    """Keep the layer scan rolled on the GPU too (models.qwen3_5.scan_layers), to compare."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help=self.__doc__, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        qwen3_5.UNROLL_LAYERS_ON_GPU = False


def layer_scan() -> str:
    """How the layers run on this backend: "unrolled" or "rolled"."""
    return "unrolled" if qwen3_5.unroll_layers() else "rolled"


def geometry_config(name: str) -> Qwen3_5Config:
    """A released Qwen3.5 geometry (random weights are written for it) with its MTP head."""
    return Qwen3_5Config(**{"vocab_size": 248320, "head_dim": 256, "linear_num_key_heads": 16,
                            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                            "mtp_num_hidden_layers": 1, "eos_token_id": (248044,), **GEOMETRIES[name]})


def weight_bytes(llm: LLM) -> int:
    """Bytes of parameters one decode step streams: everything but the MTP head (the tied
    embedding is read whole by the lm_head)."""
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    mtp = nbytes(nnx.state(llm.model.mtp)) if llm.model.mtp is not None else 0
    return nbytes(llm.engine.params) - mtp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="0.8b", choices=GEOMETRIES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rolled-layers", action=RolledLayers)
    ap.add_argument("--quantization", choices=FORMATS, default=None,
                    help="convert the projections to this weight-only format first (spec-jax convert)")
    args = ap.parse_args()

    cfg = geometry_config(args.geometry)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        write_checkpoint(d, cfg, dtype="bfloat16")
        print(f"wrote random {args.geometry} checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
        model = convert(d, f"{d}/quantized", "bfloat16", args.quantization) if args.quantization else d
        llm = LLM(model=model, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 64,
                  max_num_seqs=max(args.batch))
        wbytes = weight_bytes(llm)
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        for B in args.batch:
            prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(B)]
            t = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            compile_s = time.perf_counter() - t
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            m = outs[0].metrics
            steps = args.new_tokens - 1
            step_s = m["decode_s"] / steps
            row = {"geometry": args.geometry, "batch": B, "dtype": args.dtype, "device": jax.devices()[0].device_kind,
                   "layers": layer_scan(), "quantization": args.quantization,
                   "prefill_ms": 1e3 * m["prefill_s"], "tpot_ms": 1e3 * step_s,
                   "decode_tok_s": B * steps / m["decode_s"], "weight_GB_s": wbytes / step_s / 1e9,
                   "weight_bytes": wbytes, "first_run_s": compile_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
