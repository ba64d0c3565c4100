"""`spec-jax convert`: write a checkpoint's converted parameters with orbax-checkpoint, so that
loading it again restores the arrays (already mapped, stacked and cast) instead of converting.

    spec-jax convert --model SRC --output DIR [--dtype bfloat16] [--quantization int8|fp8|fp8_block|nvfp4]
    LLM(model=DIR)

DIR holds `params/` (Orbax), the source's config.json, generation_config.json and
tokenizer.json, and `spec_jax.json` saying how it was made, including which Linears are
quantized: those a quantized source (FP8, NVFP4) kept quantized, and with --quantization every
float projection (`loading.quantized.QUANTIZED_PROJECTIONS`), quantized with quant_formats.quantize.
`spec_jax.loading.orbax` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from pallas_kernels.quant_formats import FORMATS
from spec_jax.loading import load_model
from spec_jax.loading.gguf import find_gguf, gguf_tokenizer
from spec_jax.loading.orbax import MARKER, NVFP4_BITS, file_sizes
from spec_jax.loading.quantized import quantize_projections, quantized_linears
from spec_jax.loading.source import CheckpointError, load_config
from spec_jax.writing.random_checkpoint import hf_config

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def convert(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16",
            quantization: str | None = None) -> Path:
    """Load `src` (HF safetensors, FP8/NVFP4 or GGUF) in `dtype`, quantize its float projections to `quantization`
    (a quant_matmul format) if given, and save it under `out` for fast restores."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {str(out)!r} is not empty")
    if quantization is not None and quantization not in FORMATS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(FORMATS)}")
    model, cfg = load_model(src, dtype)
    if quantization is not None:
        quantize_projections(model, quantization)
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((out / "params").absolute(), nnx.to_pure_dict(nnx.state(model)))
    checkpointer.wait_until_finished()
    copy_side_files(src, out, cfg)
    quantized = {".".join(map(str, path)): fmt for path, fmt in quantized_linears(model).items()}
    marker = {"format": "orbax", "dtype": dtype, "source": str(src), "mtp": cfg.mtp_num_hidden_layers > 0,
              "quantized": quantized, "nvfp4_bits": NVFP4_BITS, "files": file_sizes(out / "params")}
    (out / MARKER).write_text(json.dumps(marker, indent=2))
    return out


def copy_side_files(src: str | os.PathLike, out: Path, cfg) -> None:
    """config.json, tokenizer files and generation config next to the params. A GGUF source has
    none of them: its metadata was the config, written back as config.json (and checked to read
    back as the same config), and its vocabulary becomes tokenizer.json."""
    for name in COPIED:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, out / name)
    gguf_file = find_gguf(src)
    if gguf_file is None:
        return
    (out / "config.json").write_text(json.dumps(hf_config(cfg, vl_wrapped=False), indent=2))
    if dataclasses.replace(load_config(out), mtp_num_hidden_layers=cfg.mtp_num_hidden_layers) != cfg:
        raise CheckpointError(f"the config read from {gguf_file} cannot be written as a config.json that "
                              f"reads back the same; convert supports GGUF qwen35/qwen35moe sources")
    tokenizer = gguf_tokenizer(gguf_file)
    if tokenizer is not None:
        tokenizer.hf.save(str(out / "tokenizer.json"))
