"""Loading a checkpoint by converting the HF safetensors against restoring `spec-jax convert`'s
Orbax output, on a random model of a real geometry.

    python bench/restore_vs_convert.py --geometry 0.8b

Each load is timed twice (the second, with the files in the page cache, is the one reported)
and blocks until every array is on the device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
from flax import nnx

from bench.plain_decode import GEOMETRIES, geometry_config
from spec_jax.checkpoint import load_model
from spec_jax.convert import convert
from spec_jax.random_checkpoint import write_checkpoint


def timed_load(path: str, dtype: str) -> float:
    best = None
    for _ in range(2):
        t = time.perf_counter()
        model, _ = load_model(path, dtype)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        best = time.perf_counter() - t
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="0.8b", choices=GEOMETRIES)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = str(write_checkpoint(f"{tmp}/hf", geometry_config(args.geometry), dtype="bfloat16"))
        t = time.perf_counter()
        convert(src, f"{tmp}/orbax", args.dtype)
        convert_s = time.perf_counter() - t
        row = {"geometry": args.geometry, "dtype": args.dtype, "device": jax.devices()[0].device_kind,
               "load_from_safetensors_s": timed_load(src, args.dtype), "convert_once_s": convert_s,
               "restore_from_orbax_s": timed_load(f"{tmp}/orbax", args.dtype)}
        row["restore_speedup"] = row["load_from_safetensors_s"] / row["restore_from_orbax_s"]
        print(json.dumps(row))


if __name__ == "__main__":
    main()
