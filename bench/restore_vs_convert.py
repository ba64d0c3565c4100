"""Loading a checkpoint by converting it again against restoring `spec-jax convert`'s Orbax
output, on a random model of a real geometry.

    python -m bench.restore_vs_convert --geometry 0.8b                        # bf16 safetensors
    python -m bench.restore_vs_convert --geometry 0.8b --source gguf-q8_0     # dequantized at load
    python -m bench.restore_vs_convert --geometry 0.8b --quantization int8    # quantized at load

"Convert again" is what a load without the Orbax copy has to do each time: read the source and
map, stack and cast it, plus dequantize a GGUF and quantize with --quantization. Each load is
timed twice (the second, with the files in the page cache, is reported) and blocks until every
array is on the device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
from flax import nnx

from bench.models import GEOMETRIES, geometry_config
from pallas_kernels.quant_formats import FORMATS
from spec_jax.loading import load_model
from spec_jax.loading.quantized import quantize_projections
from spec_jax.writing.convert import convert
from spec_jax.writing.gguf_writer import write_gguf
from spec_jax.writing.random_checkpoint import write_checkpoint


def timed(load) -> float:
    """Seconds of the second of two runs of `load() -> model`, arrays ready."""
    for _ in range(2):
        t = time.perf_counter()
        jax.block_until_ready(jax.tree.leaves(nnx.state(load())))
        seconds = time.perf_counter() - t
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="0.8b", choices=GEOMETRIES)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--source", default="safetensors", choices=["safetensors", "gguf-q8_0"])
    ap.add_argument("--quantization", default=None, choices=FORMATS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = str(write_checkpoint(f"{tmp}/hf", geometry_config(args.geometry), dtype="bfloat16"))
        if args.source == "gguf-q8_0":
            src = str(write_gguf(src, f"{tmp}/gguf/model.gguf", "q8_0"))

        def convert_again():
            model, _ = load_model(src, args.dtype)
            return quantize_projections(model, args.quantization) if args.quantization else model

        t = time.perf_counter()
        convert(src, f"{tmp}/orbax", args.dtype, args.quantization)
        row = {"geometry": args.geometry, "source": args.source, "quantization": args.quantization,
               "dtype": args.dtype, "device": jax.devices()[0].device_kind, "convert_once_s": time.perf_counter() - t,
               "convert_again_s": timed(convert_again),
               "restore_from_orbax_s": timed(lambda: load_model(f"{tmp}/orbax", args.dtype)[0])}
        row["restore_speedup"] = row["convert_again_s"] / row["restore_from_orbax_s"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
