"""Write an HF Qwen3.5/3.6/Next checkpoint as GGUF, the way llama.cpp's converter lays it out.

    python -m spec_jax.writing.gguf_writer HF_DIR OUT.gguf [--type f32|f16|bf16|q8_0|q4_k|q6_k] [--no-mtp]

For test checkpoints (spec_jax/writing/random_checkpoint.py writes the HF side). Names come from gguf-py's
own tables and the transforms are `checkpoint_gguf.to_gguf` (the converter's, applied forward);
the MTP head becomes the nextn block, as llama.cpp's Qwen3.5 converter writes it (its Qwen3-Next
converter drops MTP; this writer keeps it for qwen3next too).

Quantization: F16, BF16 and Q8_0 through gguf-py's `quantize`. gguf-py 0.19 cannot quantize the
K-quants (it only dequantizes them), so Q4_K and Q6_K blocks are packed here by a plain
absmax / min-max quantizer in ggml's block layout (not llama.cpp's error-minimising search, so a
little less accurate than llama-quantize); gguf-py's `dequantize` reads them back. As llama.cpp
does, 1-D tensors and the conv kernel stay F32, and a matrix whose rows do not divide into the
type's blocks falls back to Q8_0 (rows of 32) or F16.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from models.qwen3_5 import Qwen3_5Config
from spec_jax.loading.gguf import (ARCHS, GPT2_PRE_TOKENIZERS, PRE_TOKENIZER_PATTERNS, TILED_V_HEADS, arch_of,
                                   gguf_names, to_gguf)
from spec_jax.loading.source import (TensorSource, abstract_model, is_stacked, load_config, param_sources, read_json,
                                     read_tensor)
from spec_jax.writing.random_checkpoint import tensor_slots

Q = gguf.GGMLQuantizationType
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K}
MROPE_SECTIONS = [11, 11, 10, 0]  # the converter's default for qwen35 (text positions make it plain RoPE)
QK_K = 256


# ----------------------------------------------------------------------------- K-quant packing


def f16_scale(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to float16 (as stored) and as float32 for computing with."""
    h = x.astype(np.float16)
    return h, h.astype(np.float32)


def safe_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., n*256] -> Q6_K blocks uint8 [..., n*210]: 16 sub-blocks of 16 values with an
    int8 scale each and one f16 super-scale; 6-bit values split into ql (low 4) and qh (high 2)."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    nb = blocks.shape[0]
    sub = np.abs(blocks).max(-1) / 31  # [nb, 16]
    d16, d = f16_scale(sub.max(-1, keepdims=True) / 127)
    sc = np.clip(np.round(safe_divide(sub, d)), -128, 127)
    q = np.clip(np.round(safe_divide(blocks, (d * sc)[..., None])), -32, 31) + 32
    halves = q.astype(np.uint8).reshape(nb, 2, 128)
    low = (halves & 0xF).reshape(nb, 2, 2, 64)
    high = (halves >> 4).reshape(nb, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d16.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., n*256] -> Q4_K blocks uint8 [..., n*144]: 8 sub-blocks of 32 values as
    d*sc*q - dmin*m with 6-bit sc, m packed in 12 bytes, f16 d and dmin, 4-bit q."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    nb = blocks.shape[0]
    low = np.minimum(blocks.min(-1), 0)
    step, offset = (blocks.max(-1) - low) / 15, -low  # [nb, 8]
    d16, d = f16_scale(step.max(-1, keepdims=True) / 63)
    m16, dmin = f16_scale(offset.max(-1, keepdims=True) / 63)
    sc = np.clip(np.round(safe_divide(step, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.ceil(safe_divide(offset, dmin)), 0, 63).astype(np.uint8)  # ceil: the grid reaches min(x)
    q = np.clip(np.round(safe_divide(blocks + (dmin * m)[..., None], (d * sc)[..., None])), 0, 15).astype(np.uint8)
    pairs = q.reshape(nb, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(nb, 128)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    out = np.concatenate([d16.view(np.uint8), m16.view(np.uint8), scales, qs], axis=1)
    return out.reshape(*x.shape[:-1], -1)


K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}


def storage_type(name: str, x: np.ndarray, qtype: Q) -> Q:
    """What one tensor is stored as when the file's type is `qtype`."""
    if x.ndim < 2 or name.endswith("conv1d.weight") or qtype == Q.F32:
        return Q.F32
    for candidate in (qtype, Q.Q8_0, Q.F16):
        if x.shape[-1] % gguf.GGML_QUANT_SIZES[candidate][0] == 0:
            return candidate
    return Q.F16


def encode(x: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """(array for GGUFWriter.add_tensor, its raw_dtype)."""
    if qtype in (Q.F32, Q.F16):
        return x.astype(np.float32 if qtype == Q.F32 else np.float16), None
    if qtype in K_QUANTIZERS:
        return K_QUANTIZERS[qtype](x), qtype
    return gguf.quants.quantize(x, qtype), qtype


# ----------------------------------------------------------------------------- tensors


def converted_names(cfg: Qwen3_5Config) -> list[str]:
    """The HF tensors the converter writes, in parameter order (qwen3next: `in_proj_ba` fused)."""
    names = [n for n, _ in tensor_slots(lambda: abstract_model(cfg, np.float32),
                                        lambda p: (param_sources(p, cfg), is_stacked(p)))]
    if arch_of(cfg) == "qwen3next":
        names = [n.replace("in_proj_b.", "in_proj_ba.") for n in names if ".in_proj_a." not in n]
    return names


def hf_tensor(src: TensorSource, name: str, cfg: Qwen3_5Config) -> np.ndarray:
    """One HF tensor; qwen3next's key-head-grouped `in_proj_ba` is fused from split a/b if need be."""
    if name.endswith("in_proj_ba.weight") and name not in src:
        nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        b, a = (read_tensor(src, name.replace("in_proj_ba", p), cfg) for p in ("in_proj_b", "in_proj_a"))
        return np.concatenate([b.reshape(nk, r, -1), a.reshape(nk, r, -1)], axis=1).reshape(2 * nk * r, -1)
    return read_tensor(src, name, cfg)


# ----------------------------------------------------------------------------- metadata


def write_metadata(w: gguf.GGUFWriter, cfg: Qwen3_5Config, type_name: str) -> None:
    n = cfg.full_attention_interval
    if cfg.layer_types != Qwen3_5Config(num_hidden_layers=cfg.num_hidden_layers, full_attention_interval=n).layer_types:
        raise ValueError(f"layer_types {cfg.layer_types} is not every {n}th layer full attention; GGUF "
                         f"stores only full_attention_interval")
    w.add_name(f"random {arch_of(cfg)}")
    w.add_file_type(FILE_TYPES[type_name])
    w.add_block_count(cfg.num_hidden_layers + cfg.mtp_num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)  # as the converter does whenever config.json has it
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    if arch_of(cfg) in TILED_V_HEADS:
        w.add_rope_dimension_sections(MROPE_SECTIONS)
    w.add_full_attention_interval(n)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.value_dim)
    if cfg.is_moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    if cfg.mtp_num_hidden_layers:
        w.add_nextn_predict_layers(cfg.mtp_num_hidden_layers)
    for add, token in zip((w.add_eos_token_id, w.add_eot_token_id), cfg.eos_token_id):
        add(token)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's `tokenizer.ggml.pre` name for a tokenizer.json's pre-tokenizer, if known."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PRE_TOKENIZERS[0]
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    patterns = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    return next((name for name, rx in PRE_TOKENIZER_PATTERNS.items() if patterns == [rx]), None)


def write_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, cfg: Qwen3_5Config) -> bool:
    """Write `tokenizer.ggml.*` (model gpt2) from HF_DIR/tokenizer.json when it is a byte-level
    BPE with a known pre-tokenizer. Returns whether it did."""
    path = hf_dir / "tokenizer.json"
    if not path.exists():
        return False
    tj = read_json(path)
    model, pre = tj.get("model", {}), pre_tokenizer_name(tj)
    if model.get("type") != "BPE" or pre is None:
        print(f"note: {path} is not a byte-level BPE with a known pre-tokenizer; the GGUF gets no tokenizer "
              f"(keep tokenizer.json next to it)")
        return False
    vocab = dict(model["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    vocab.update({t["content"]: i for i, t in added.items()})
    size = max(cfg.vocab_size, max(vocab.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [gguf.TokenType.UNUSED] * size
    for token, i in vocab.items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for i, t in added.items():
        types[i] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    return True


# ----------------------------------------------------------------------------- writing


def write_gguf(hf_dir: str | os.PathLike, out: str | os.PathLike, type_name: str = "f32", *, mtp: bool = True,
               fused_experts: bool = False, progress: bool = False) -> Path:
    """Convert the HF checkpoint in `hf_dir` to the GGUF file `out`, tensors stored as `type_name`
    (a key of TYPES). mtp=False leaves the nextn block out, as `--no-mtp` converters do;
    fused_experts stores routed experts as one `ffn_gate_up_exps` (a layout llama.cpp also reads)."""
    if type_name not in TYPES:
        raise ValueError(f"unknown GGUF type {type_name!r}; expected one of {', '.join(TYPES)}")
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = load_config(hf_dir)
    src = TensorSource(hf_dir)
    if not mtp or "mtp.fc.weight" not in src:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    arch, L = arch_of(cfg), cfg.num_hidden_layers
    tensor_map = gguf.get_tensor_name_map(ARCHS[arch], L + 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, arch)
    write_metadata(w, cfg, type_name)
    write_tokenizer(w, hf_dir, cfg)
    for name in tqdm(converted_names(cfg), desc="converting", disable=not progress):
        x = to_gguf(name, hf_tensor(src, name, cfg), cfg)
        targets = gguf_names(name, arch, L, tensor_map, fused_experts=fused_experts)
        parts = np.split(x, 2, axis=-2) if len(targets) == 2 else [x]  # experts: gate rows, then up rows
        for target, part in zip(targets, parts):
            data, raw_dtype = encode(part, storage_type(name, part, TYPES[type_name]))
            w.add_tensor(target, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=progress)
    w.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m spec_jax.writing.gguf_writer", description=__doc__.split("\n")[0])
    ap.add_argument("hf_dir", help="an HF Qwen3.5/3.6/Next safetensors checkpoint directory")
    ap.add_argument("out", help="the .gguf file to write")
    ap.add_argument("--type", default="f32", choices=list(TYPES), help="how matrices are stored (default f32)")
    ap.add_argument("--no-mtp", action="store_true", help="leave the MTP head (nextn block) out")
    args = ap.parse_args(argv)
    out = write_gguf(args.hf_dir, args.out, args.type, mtp=not args.no_mtp, progress=True)
    print(f"wrote {out} ({out.stat().st_size} bytes, {args.type})")


if __name__ == "__main__":
    main()
