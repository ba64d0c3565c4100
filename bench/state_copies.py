"""Which per-row state a compiled decode program copies every step: for each leaf of the decode
state (the target's caches, the proposer's state), how many `copy` instructions of its exact shape
the optimized HLO runs inside the decode loop. A copy of the GDN recurrent state (float32,
[G, B, nv, dk, dv]) reads and writes all of it once more per step: at 27B dims and batch 32 the
48 GDN layers hold 4.8 GB.

    python -m bench.state_copies --geometry 27b --layers 8 --batch 32
    python -m bench.state_copies --geometry 27b --layers 8 --batch 32 \
        --spec '{"method": "mtp", "num_speculative_tokens": 3}'

Per program (plain, then each --spec): leaf path, shape, bytes, copies, and the bytes the copies
move per step (read plus written); with --json, the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re

import jax

from bench.models import GEOMETRIES, geometry_config, random_model, random_prompts
from spec_jax import LLM, SamplingParams
from spec_jax.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, claim_device_memory

HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "s32", "int8": "s8", "bool": "pred"}


def hlo_shape(leaf) -> str:
    """A leaf's shape as HLO prints it, e.g. f32[16,32,48,128,128]."""
    return f"{HLO_DTYPES.get(str(leaf.dtype), str(leaf.dtype))}[{','.join(map(str, leaf.shape))}]"


def computations(hlo: str) -> dict[str, str]:
    """An HLO module's text split into its computations: name -> body text."""
    found, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and name is None:
            name, lines = head.group(1), []
        elif line.startswith("}") and name is not None:
            found[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return found


def loop_text(hlo: str) -> str:
    """The text of every computation a while loop's body runs (its branches, calls and nested
    loops included): what runs once per step of the decode loop."""
    comps = computations(hlo)
    callee = r"(?:body|condition|to_apply|calls|branch_computations=\{)[=]?%?([\w.\-]+)|, %([\w.\-]+)"
    todo = [b for text in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", text)]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [a or b for a, b in re.findall(callee, comps[name])]
    return "\n".join(comps[name] for name in seen)


def copies_of(hlo: str, shape: str) -> int:
    """copy instructions inside the decode loop whose result has exactly `shape` (any layout)."""
    return len(re.findall(re.escape("= " + shape) + r"(?:\{[^}]*\})? copy\(", loop_text(hlo)))


def program_copies(llm: LLM, batch: int, prompt_len: int) -> list[dict]:
    """Per state leaf of `llm`'s decode program at `batch` rows: its copies in the optimized HLO."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(llm.cfg, batch, prompt_len)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # compiles decode
    state = llm.prefill(prompts, params)
    hlo = "\n".join(program.as_text() for key, (program, _) in llm.engine.runner.executables.items()
                    if key[0] == "decode")
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path((state.cache, state.proposer)):
        if not hasattr(leaf, "shape") or leaf.ndim < 2:
            continue
        shape = hlo_shape(leaf)
        n = copies_of(hlo, shape)
        rows.append({"leaf": ("cache" if path[0].idx == 0 else "proposer") + jax.tree_util.keystr(path[1:]),
                     "shape": shape, "MB": leaf.nbytes / 1e6, "copies": n,
                     "copied_GB_per_step": 2 * n * leaf.nbytes / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="27b", choices=GEOMETRIES)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--spec", action="append", default=[], help="a speculative config (JSON); repeatable")
    ap.add_argument("--json", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    args = ap.parse_args()

    claim_device_memory(args.gpu_memory_utilization)
    cfg = geometry_config(args.geometry, args.layers)
    llm = LLM(model=random_model(cfg), max_model_len=args.max_model_len, max_num_seqs=args.batch,
              batch_buckets=[args.batch])
    result = {"geometry": args.geometry, "layers": cfg.num_hidden_layers, "batch": args.batch,
              "device": jax.devices()[0].device_kind, "programs": {}}
    for spec in [None, *args.spec]:
        run = llm if spec is None else llm.with_speculation(json.loads(spec))
        rows = program_copies(run, args.batch, args.prompt_len)
        result["programs"][spec or "plain"] = rows
        print(f"{spec or 'plain'}: {sum(r['copied_GB_per_step'] for r in rows):.3f} GB copied a step")
        for r in rows:
            if r["copies"]:
                print(f"  {r['leaf']:<28} {r['shape']:<28} {r['MB']:9.1f} MB x {r['copies']} copies")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
