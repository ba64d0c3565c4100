"""Loading quantized checkpoints: Qwen's official FP8 and NVIDIA ModelOpt NVFP4, kept quantized.

Formats (`config.json` `quantization_config`, or ModelOpt's legacy `hf_quant_config.json`):
  FP8     {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}: each
          quantized Linear stores `weight` float8_e4m3fn [N, K] and `weight_scale_inv` (bf16 or
          f32) [ceil(N/128), ceil(K/128)], W = fp8 * weight_scale_inv per 128 x 128 block;
  NVFP4   {"quant_method": "modelopt", "quant_algo": "NVFP4", ...}: `weight` uint8 [N, K/2] (two
          e2m1 codes a byte, the even column in the low nibble), `weight_scale` float8_e4m3fn
          [N, K/16], `weight_scale_2` f32 [], W = e2m1 * weight_scale * weight_scale_2;
          `input_scale` (static activation scale for W4A4) is not read: activations stay bf16.

Which Linears are quantized is read from the tensors themselves (the weight's stored dtype), so
layers a format leaves in bf16 (embeddings, lm_head, norms, the GDN in_proj_a/in_proj_b, routers,
whatever the ignore list names, and ModelOpt's mtp.fc, which its lists omit) stay float. A
projection (`QUANTIZED_PROJECTIONS`) stored quantized in every repeat of its layer stays quantized
in the model; anything else stored quantized — routed experts, lm_head, a projection quantized in
some repeats only — is dequantized at load (the experts' ragged_dot runs on float weights).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from models.layers import SCALE_NAMES, Linear, quantize_linears
from models.qwen3_5 import Qwen3_5Config
from pallas_kernels.quant_formats import QuantizedWeight, dequantize, nvfp4_from_modelopt, quantize
from spec_jax.loading.source import CheckpointError, TensorSource, param_sources, read_json

# Linears that the published FP8 and NVFP4 checkpoints quantize (module names, any layer).
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                         "gate_proj", "up_proj", "down_proj")
CODE_DTYPES = {"fp8_block": "F8_E4M3", "nvfp4": "U8"}  # safetensors dtype of a quantized weight
SUPPORTED = "'fp8' (weight_block_size [128, 128]) and 'modelopt' (quant_algo NVFP4)"
dequantize_jit = jax.jit(dequantize)  # one compiled program per weight shape (experts share theirs)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: format is a quant_matmul format; ignore lists the modules the
    producer left unquantized (informational: the tensors' dtypes decide)."""

    format: str
    ignore: tuple[str, ...] = ()


def read_quant_scheme(model_dir: str | os.PathLike) -> QuantScheme | None:
    """The quantization named by config.json's `quantization_config` (or hf_quant_config.json);
    None for an unquantized checkpoint. Raises CheckpointError for any other method."""
    model_dir = Path(model_dir)
    qc = read_json(model_dir / "config.json").get("quantization_config")
    if qc is None and (model_dir / "hf_quant_config.json").exists():
        qc = {"quant_method": "modelopt", **read_json(model_dir / "hf_quant_config.json")}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if qc.get("weight_block_size") != [128, 128] or qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"fp8 quantization_config with weight_block_size {qc.get('weight_block_size')} "
                                  f"and fmt {qc.get('fmt')!r} is not supported; expected [128, 128] blocks of e4m3")
        return QuantScheme("fp8_block", tuple(qc.get("modules_to_not_convert") or ()))
    if method == "modelopt":
        inner = qc.get("quantization") or qc  # legacy files nest the settings under "quantization"
        algo = str(inner.get("quant_algo", "")).upper()
        if algo not in ("NVFP4", "W4A16_NVFP4") or inner.get("group_size", 16) != 16:
            raise CheckpointError(f"ModelOpt quant_algo {algo!r} with group_size {inner.get('group_size')} is not "
                                  f"supported; spec_jax loads NVFP4 with group_size 16")
        return QuantScheme("nvfp4", tuple(inner.get("ignore") or inner.get("exclude_modules") or ()))
    raise CheckpointError(f"{model_dir / 'config.json'} has quantization_config.quant_method {method!r}; "
                          f"spec_jax loads {SUPPORTED}")


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor table, byte offset of the data) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class QuantizedSource(TensorSource):
    """A TensorSource over a quantized checkpoint. `get` returns codes and scales as stored for
    the Linears the model keeps quantized (`keep_quantized`) and dequantized float32 weights for
    every other quantized tensor, so the float loaders (fused experts, Qwen3-Next unfusing) work
    unchanged."""

    def __init__(self, model_dir: str | os.PathLike, scheme: QuantScheme):
        super().__init__(model_dir)
        self.model_dir = Path(model_dir)
        self.scheme = scheme
        self.kept: set[str] = set()  # module names (`...q_proj`) read as codes and scales
        self.headers = {}

    def stored_dtype(self, name: str) -> str:
        fname, stored = self.location[name]
        return self.files[fname].get_slice(stored).get_dtype()

    def is_quantized(self, name: str) -> bool:
        return name in self and self.stored_dtype(name) == CODE_DTYPES[self.scheme.format]

    def raw(self, name: str) -> np.ndarray:
        """A tensor as stored; float8 ones are read from the file directly (numpy has no float8)."""
        if name not in self or self.stored_dtype(name) != "F8_E4M3":
            return super().get(name)
        fname, stored = self.location[name]
        self.read.add(name)
        if fname not in self.headers:
            self.headers[fname] = safetensors_header(self.model_dir / fname)
        table, start = self.headers[fname]
        begin, end = table[stored]["data_offsets"]
        data = np.fromfile(self.model_dir / fname, np.uint8, count=end - begin, offset=start + begin)
        return data.view(ml_dtypes.float8_e4m3fn).reshape(table[stored]["shape"])

    def quantized_weight(self, module: str) -> QuantizedWeight:
        """The codes and scales of one quantized Linear (`module` = its name without `.weight`)."""
        fmt = self.scheme.format
        data = self.codes(f"{module}.weight")
        N, K = data.shape[0], data.shape[1] * (2 if fmt == "nvfp4" else 1)
        want = jax.eval_shape(functools.partial(quantize, fmt=fmt), jax.ShapeDtypeStruct((N, K), np.float32))
        scale_name, global_name = SCALE_NAMES[fmt]
        arrays = {}
        for field, name in (("scale", scale_name), ("global_scale", global_name)):
            if name is None:
                continue
            arr = self.raw(f"{module}.{name}")
            expected = getattr(want, field)
            if arr.size != int(np.prod(expected.shape)) or (field == "scale" and arr.shape != expected.shape):
                raise CheckpointError(f"tensor '{module}.{name}' has shape {arr.shape}, expected {expected.shape} "
                                      f"for a {fmt} weight of shape {(N, K)}")
            arrays[field] = np.asarray(arr).astype(expected.dtype).reshape(expected.shape)
        return QuantizedWeight(data, arrays["scale"], arrays.get("global_scale"), fmt)

    def codes(self, name: str) -> np.ndarray:
        """A quantized Linear's `weight` as quant_matmul holds it: NVFP4's ModelOpt nibbles are moved
        into the kernels' bit layout (`quant_formats.E2M1_BITS`); FP8 codes are the stored bytes."""
        data = self.raw(name)
        return nvfp4_from_modelopt(data) if self.scheme.format == "nvfp4" else data

    def get(self, name: str) -> np.ndarray:
        module, leaf = name.rsplit(".", 1)
        if module in self.kept:
            if leaf == "weight":
                return self.codes(name)
            arr = self.raw(name)
            return arr.reshape(()) if leaf == "weight_scale_2" else arr  # some exports store it as [1]
        if not self.is_quantized(name):
            return super().get(name)
        if leaf != "weight":
            raise CheckpointError(f"tensor {name!r} is stored as {self.stored_dtype(name)}; spec_jax reads quantized "
                                  f"tensors only as Linear weights (`.weight`)")
        return np.asarray(dequantize_jit(self.quantized_weight(module)))

    def keep_quantized(self, make_model, cfg: Qwen3_5Config):
        """`make_model` with every projection that is quantized in all its repeats made quantized;
        records those modules so `get` returns their codes and scales."""
        formats = {}
        for path, module in nnx.iter_modules(nnx.eval_shape(make_model)):
            if not (isinstance(module, Linear) and path and path[-1] in QUANTIZED_PROJECTIONS):
                continue
            names = [n.removesuffix(".weight") for n in param_sources((*path, "weight"), cfg)]
            if all(self.is_quantized(f"{n}.weight") for n in names):
                formats[path] = self.scheme.format
                self.kept.update(names)
        return lambda: quantize_linears(make_model(), formats)


def quantized_linears(model: nnx.Module) -> dict[tuple, str]:
    """Module path -> format of every quantized Linear in `model`."""
    return {path: m.format for path, m in nnx.iter_modules(model) if isinstance(m, Linear) and m.format}


def quantize_projections(model: nnx.Module, fmt: str) -> nnx.Module:
    """Quantize (in place, with quant_formats.quantize) every float projection the published
    quantized checkpoints quantize (`QUANTIZED_PROJECTIONS`); other Linears stay float."""
    paths = {path: fmt for path, m in nnx.iter_modules(model)
             if isinstance(m, Linear) and m.format is None and path and path[-1] in QUANTIZED_PROJECTIONS}
    return quantize_linears(model, paths)
