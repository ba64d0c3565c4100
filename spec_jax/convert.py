"""`spec-jax convert`: write a checkpoint's converted parameters with orbax-checkpoint, so that
loading it again restores the arrays (already mapped, stacked and cast) instead of converting.

    spec-jax convert --model SRC --output DIR [--dtype bfloat16] [--quantization int8|fp8|fp8_block|nvfp4]
    LLM(model=DIR)

DIR holds `params/` (Orbax), the source's config.json, generation_config.json and
tokenizer.json, and `spec_jax.json` saying how it was made, including which Linears are
quantized: those a quantized source (FP8, NVFP4) kept quantized, and with --quantization every
float projection (`checkpoint_quant.QUANTIZED_PROJECTIONS`), quantized with quant_matmul.quantize.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from pallas_kernels.quant_matmul import E2M1_BITS, FORMATS, nvfp4_from_modelopt
from spec_jax.checkpoint import CheckpointError, load_config, load_model, read_json, resolve_dtype
from spec_jax.checkpoint_quant import quantize_projections, quantized_linears

MARKER = "spec_jax.json"
NVFP4_BITS = [list(b) for b in E2M1_BITS]  # the NVFP4 byte layout as the marker records it
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def is_converted(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / MARKER).exists()


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


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file under `folder` (relative path) and its size in bytes."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def check_file_sizes(model_dir: Path, marker: dict) -> None:
    """Every file the marker lists under params/ is there at its saved size (a truncated or lost
    file is refused by name; a same-size corruption is not detected). Directories converted
    before the marker listed files are not checked."""
    for name, size in (marker.get("files") or {}).items():
        path = model_dir / "params" / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise CheckpointError(f"{path} was saved with {size} bytes and is {found}: the converted directory "
                                  f"is damaged; convert the model again")


def copy_side_files(src: str | os.PathLike, out: Path, cfg) -> None:
    """config.json, tokenizer files and generation config next to the params. A GGUF source has
    none of them: its metadata was the config, written back as config.json (and checked to read
    back as the same config), and its vocabulary becomes tokenizer.json."""
    from spec_jax.checkpoint_gguf import find_gguf, gguf_tokenizer
    from spec_jax.random_checkpoint import hf_config

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


def restore(model_dir: str | os.PathLike, dtype: str | None = None):
    """A converted directory -> (Qwen3_5Model, Qwen3_5Config), restored in the dtype it was saved
    in and cast if another is asked for."""
    from models.qwen3_5 import Qwen3_5Model, quantize_linears

    model_dir = Path(model_dir)
    marker = read_json(model_dir / MARKER)
    if marker.get("format") != "orbax":
        raise CheckpointError(f"{model_dir / MARKER} names format {marker.get('format')!r}; expected 'orbax'")
    cfg = load_config(model_dir)
    if not marker.get("mtp", True):
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    formats = {tuple(int(k) if k.isdigit() else k for k in path.split(".")): fmt
               for path, fmt in marker.get("quantized", {}).items()}

    def abstract(dtype):
        return nnx.split(nnx.eval_shape(lambda: quantize_linears(Qwen3_5Model(cfg, dtype=dtype), formats)))

    saved = resolve_dtype(marker.get("dtype", "float32"))
    graphdef, state = abstract(saved)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    check_file_sizes(model_dir, marker)
    try:
        params = ocp.StandardCheckpointer().restore((model_dir / "params").absolute(), shapes)
    except Exception as e:  # Orbax and TensorStore raise their own types; none should escape raw
        raise CheckpointError(f"cannot restore {model_dir / 'params'}: {type(e).__name__}: {e}") from None
    wanted = resolve_dtype(dtype) if dtype else saved
    if wanted != saved:  # cast to the leaves' dtypes in the wanted model (norms, codes and scales keep theirs)
        graphdef, state = abstract(wanted)
        params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, nnx.to_pure_dict(state))
    nvfp4_bytes_as_saved(params, formats, marker, model_dir)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state), cfg


def nvfp4_bytes_as_saved(params: dict, formats: dict[tuple, str], marker: dict, model_dir: Path) -> None:
    """Bring restored NVFP4 codes into today's byte layout (quant_matmul.E2M1_BITS), in place.
    Directories converted before the marker named it hold ModelOpt's nibbles (the even column low)."""
    saved = marker.get("nvfp4_bits")
    if saved == NVFP4_BITS or "nvfp4" not in formats.values():
        return
    if saved is not None:
        raise CheckpointError(f"{model_dir / MARKER} names NVFP4 bit positions {saved}; this version reads "
                              f"{NVFP4_BITS} or ModelOpt's nibbles: convert the model again")
    for path, fmt in formats.items():
        if fmt == "nvfp4":
            leaf = functools.reduce(lambda d, k: d[k], path, params)
            leaf["weight"] = nvfp4_from_modelopt(leaf["weight"])
