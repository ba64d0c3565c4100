"""Quantize a small HF checkpoint into a published quantized layout, for tests and benchmarks:

    python -m spec_jax.writing.quantize_checkpoint SRC_DIR OUT_DIR --format fp8|nvfp4

fp8    Qwen's official FP8 (Qwen/Qwen3.6-27B-FP8 and kin): the projections (`QUANTIZED_PROJECTIONS`,
       routed experts split one tensor per expert) become float8_e4m3fn `weight` plus
       `weight_scale_inv` [ceil(N/128), ceil(K/128)] (bf16, as reported for Qwen3.5/3.6; f32 with
       --scale-dtype float32); config.json gets `quantization_config` with `modules_to_not_convert`
       listing every module left in bf16.
nvfp4  NVIDIA ModelOpt NVFP4: the same projections outside the MTP block become uint8 `weight`
       [N, K/2], float8_e4m3fn `weight_scale` [N, K/16], f32 `weight_scale_2` [] and a placeholder
       f32 `input_scale` [] (no activation calibration here; spec_jax runs NVFP4 weight-only);
       config.json's `quantization_config` lists the excluded modules under `ignore` and the
       legacy hf_quant_config.json under `exclude_modules`. Projections whose input size is not a
       multiple of 32 stay bf16 and are listed as excluded.

Everything else (embeddings, lm_head, norms, in_proj_a/in_proj_b, routers, conv1d, A_log,
dt_bias) is copied as stored.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from pallas_kernels.quant_formats import GROUP, nvfp4_to_modelopt, quantize
from spec_jax.loading.quantized import QUANTIZED_PROJECTIONS
from spec_jax.loading.source import TensorSource, read_json

FORMATS = ("fp8", "nvfp4")
quantize_jit = jax.jit(quantize, static_argnames="fmt")  # one compiled program per weight shape
SCALE_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.37.0"}


def stored_tensors(src_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint under its stored name, fused experts split per expert
    (`experts.gate_up_proj` [E, 2I, H] -> `experts.{e}.gate_proj/up_proj.weight` [I, H])."""
    src = TensorSource(src_dir)
    out = {}
    for fname, handle in src.files.items():
        for name in handle.keys():
            value = handle.get_tensor(name)
            base, leaf = name.rsplit(".", 1)
            if leaf == "gate_up_proj" and base.endswith("experts"):
                gate, up = np.split(value, 2, axis=1)
                for e in range(value.shape[0]):
                    out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate[e], up[e]
            elif leaf == "down_proj" and base.endswith("experts"):
                for e in range(value.shape[0]):
                    out[f"{base}.{e}.down_proj.weight"] = value[e]
            else:
                out[name] = value
    return out


def quantizes(name: str, value: np.ndarray, fmt: str) -> bool:
    """Whether the published `fmt` layout stores this tensor quantized."""
    module = name.removesuffix(".weight")
    if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS:
        return False
    if "visual" in name or (fmt == "nvfp4" and name.startswith("mtp.")):
        return False  # vision towers stay bf16 in both; ModelOpt exports also exclude the MTP block
    return fmt == "fp8" or value.shape[1] % (2 * GROUP) == 0


def quantized_tensors(module: str, w: np.ndarray, fmt: str, scale_dtype) -> dict[str, np.ndarray]:
    """The tensors that replace `module.weight` [N, K] in the `fmt` layout."""
    if fmt == "fp8":
        q = quantize_jit(w, fmt="fp8_block")
        return {f"{module}.weight": np.asarray(q.data),
                f"{module}.weight_scale_inv": np.asarray(q.scale).astype(scale_dtype)}
    q = quantize_jit(w, fmt="nvfp4")
    return {f"{module}.weight": nvfp4_to_modelopt(q.data), f"{module}.weight_scale": np.asarray(q.scale),
            f"{module}.weight_scale_2": np.asarray(q.global_scale, np.float32),
            f"{module}.input_scale": np.asarray(1.0 / (6.0 * 448.0), np.float32)}


def quant_config(fmt: str, left_float: list[str]) -> dict:
    """config.json's `quantization_config` for the layout."""
    if fmt == "fp8":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": left_float,
                "quant_method": "fp8", "weight_block_size": [128, 128]}
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP}
    return {"config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
            "ignore": left_float, "producer": MODELOPT_PRODUCER, "quant_algo": "NVFP4", "quant_method": "modelopt"}


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, fmt: str, *, scale_dtype: str = "bfloat16") -> Path:
    """Write `src_dir`'s checkpoint to `out_dir` in the published `fmt` ('fp8' | 'nvfp4') layout."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale dtype {scale_dtype!r}; expected one of {', '.join(SCALE_DTYPES)}")
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, left_float = {}, set()
    for name, value in stored_tensors(src_dir).items():
        if quantizes(name, value, fmt):
            tensors.update(quantized_tensors(name.removesuffix(".weight"), value.astype(np.float32), fmt,
                                             SCALE_DTYPES[scale_dtype]))
            continue
        tensors[name] = value
        if fmt == "fp8" and "embed_tokens" not in name:
            left_float.add(name.removesuffix(".weight"))  # Qwen lists every bf16 module but the embeddings
        elif fmt == "nvfp4" and value.ndim == 2 and not name.startswith("mtp.") and "embed_tokens" not in name:
            left_float.add(name.removesuffix(".weight"))  # ModelOpt lists the Linears it skipped
    if fmt == "nvfp4" and any(n.startswith("mtp.") for n in tensors):
        left_float.add("mtp*")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for path in src_dir.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors.index.json") \
                and path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    config = read_json(src_dir / "config.json")
    config["quantization_config"] = quant_config(fmt, sorted(left_float))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "nvfp4":
        legacy = {"producer": MODELOPT_PRODUCER,
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                                   "exclude_modules": sorted(left_float)}}
        (out_dir / "hf_quant_config.json").write_text(json.dumps(legacy, indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m spec_jax.writing.quantize_checkpoint",
                                 description="Quantize a small HF checkpoint into Qwen's FP8 or ModelOpt's NVFP4 "
                                             "layout.")
    ap.add_argument("src", help="an HF safetensors checkpoint directory (bf16 or f32)")
    ap.add_argument("out", help="the directory to write")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--scale-dtype", default="bfloat16", choices=tuple(SCALE_DTYPES),
                    help="fp8: dtype of weight_scale_inv")
    args = ap.parse_args(argv)
    quantize_checkpoint(args.src, args.out, args.format, scale_dtype=args.scale_dtype)
    print(f"wrote a {args.format} checkpoint of {args.src} to {args.out}")


if __name__ == "__main__":
    main()
