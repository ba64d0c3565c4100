"""Loading GGUF targets (llama.cpp's `qwen35`, `qwen35moe` and `qwen3next`) into the NNX model.

A `GGUFSource` answers the same questions as `checkpoint.TensorSource` — by the text-only HF
tensor name — so the safetensors loader's mapping (`param_sources`, `read_tensor`, `fill_params`)
runs unchanged. Underneath, each HF name maps to its GGUF name through gguf-py's own tables
(`gguf.get_tensor_name_map`, `gguf.TENSOR_NAMES`), the tensor is dequantized with gguf-py's
`dequantize` (F32, F16, BF16, Q8_0, the K-quants, ...), and llama.cpp's converter transforms are
undone:

* `ssm_a` holds -exp(A_log);
* zero-centred norm weights are stored + 1 (every `*norm.weight` but the GDN `ssm_norm`);
* `ssm_conv1d` is squeezed [C, K];
* qwen35/qwen35moe store value heads "tiled" ([r, nk] instead of HF's [nk, r]) in the V rows of
  `attn_qkv` and `ssm_conv1d`, the rows of `attn_gate`, `ssm_alpha`, `ssm_beta`, the elements
  of `ssm_a`, `ssm_dt` and the columns of `ssm_out`;
* routed experts are split into `ffn_gate_exps` / `ffn_up_exps`;
* qwen3next keeps `in_proj_ba` key-head-grouped as `ssm_ba` (checkpoint.unfuse_qwen3_next splits it).

The MTP head is the `nextn` block: block L = num_hidden_layers holds the MTP decoder layer under
the ordinary per-layer names plus `blk.L.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from spec_jax.loading.source import CheckpointError, fill_params, is_stacked, param_sources, read_tensor
from spec_jax.loading.tokenizer import Tokenizer

ARCHS = {"qwen35": gguf.MODEL_ARCH.QWEN35, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
         "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}
MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
TILED_V_HEADS = ("qwen35", "qwen35moe")  # the converter reorders value heads for these only
NEXTN = {"mtp.fc.weight": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
         "mtp.pre_fc_norm_embedding.weight": gguf.MODEL_TENSOR.NEXTN_ENORM,
         "mtp.pre_fc_norm_hidden.weight": gguf.MODEL_TENSOR.NEXTN_HNORM,
         "mtp.norm.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}
# Pre-tokenizer split patterns of the `tokenizer.ggml.pre` names this loader can rebuild (the
# patterns of the models' own tokenizer.json files; llama.cpp keys its copies by these names).
PRE_TOKENIZER_PATTERNS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
GPT2_PRE_TOKENIZERS = ("gpt2", "default")  # byte-level BPE with GPT-2's own split


def arch_of(cfg: Qwen3_5Config) -> str:
    """The GGUF architecture name of a config: qwen35, qwen35moe or qwen3next."""
    if cfg.model_type == "qwen3_next":
        return "qwen3next"
    return "qwen35moe" if cfg.is_moe else "qwen35"


def find_gguf(model: str | os.PathLike) -> Path | None:
    """The GGUF file `model` names: the file itself, or the one `.gguf` in a directory that holds
    no safetensors. None when `model` is not a GGUF checkpoint."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                              f"pass the one to load (split GGUFs are not supported: merge them with llama-gguf-split)")
    return files[0] if files else None


# ----------------------------------------------------------------------------- names


def gguf_names(name: str, arch: str, n_layers: int, tensor_map: gguf.TensorNameMap, *,
               fused_experts: bool = False) -> list[str] | None:
    """Text-only HF tensor name -> its GGUF tensor name(s), or None if `arch` has no such tensor.

    `mtp.layers.0.*` is block n_layers; the routed experts' `gate_up_proj` is two GGUF tensors
    (`ffn_gate_exps`, `ffn_up_exps`), or with fused_experts the one `ffn_gate_up_exps`.
    """
    if name in NEXTN:
        return [gguf.TENSOR_NAMES[NEXTN[name]].format(bid=n_layers) + ".weight"]
    if name.startswith("mtp.layers."):
        _, _, index, rest = name.split(".", 3)
        name = f"model.layers.{n_layers + int(index)}.{rest}"
    if name.endswith("experts.gate_up_proj") and not fused_experts:
        parts = [gguf_names(name.replace("gate_up_proj", proj), arch, n_layers, tensor_map)
                 for proj in ("gate_proj", "up_proj")]
        return None if None in parts else parts[0] + parts[1]
    if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj", "experts.gate_up_proj")):
        name += ".weight"  # llama.cpp names the stacked experts blk.N.ffn_*_exps.weight
    if name.endswith(".dt_bias"):
        name = name[: -len("dt_bias")] + "dt_proj.bias"  # the converter's rename
    base, suffix = (name[: -len(".weight")], ".weight") if name.endswith(".weight") else (
        (name[: -len(".bias")], ".bias") if name.endswith(".bias") else (name, ""))
    mapped = tensor_map.get_name(base)
    return None if mapped is None else [mapped + suffix]


# ----------------------------------------------------------------------------- transforms


def is_shifted_norm(name: str) -> bool:
    """Zero-centred RMSNorm weights, which the converter stores as 1 + w (not the GDN gated norm)."""
    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return "norm" in module and not name.endswith("linear_attn.norm.weight")


def reorder_v_heads(x: np.ndarray, axis: int, cfg: Qwen3_5Config, head_dim: int, *, to_tiled: bool) -> np.ndarray:
    """Value heads along `axis` between HF's grouped order (value head g*r + j belongs to key head
    g) and llama.cpp's tiled order (j*nk + g): view the axis as [nk, r, d] and swap to [r, nk, d]."""
    nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    axis = axis % x.ndim
    split = (nk, r, head_dim) if to_tiled else (r, nk, head_dim)
    y = x.reshape(x.shape[:axis] + split + x.shape[axis + 1 :])
    return np.swapaxes(y, axis, axis + 1).reshape(x.shape)


def reorder_gdn(name: str, x: np.ndarray, cfg: Qwen3_5Config, *, to_tiled: bool) -> np.ndarray:
    """Apply (or undo) the value-head reordering to one GDN tensor in its GGUF shape (conv1d
    squeezed to [C, K]); other tensors pass through."""
    if cfg.linear_num_key_heads == cfg.linear_num_value_heads or ".linear_attn." not in name:
        return x
    dv, qk = cfg.linear_value_head_dim, 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    reorder = lambda y, axis, d: reorder_v_heads(y, axis, cfg, d, to_tiled=to_tiled)  # noqa: E731
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([x[:qk], reorder(x[qk:], 0, dv)])  # q and k channels stay
    if name.endswith("in_proj_z.weight"):
        return reorder(x, 0, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return reorder(x, 0, 1)
    if name.endswith("out_proj.weight"):
        return reorder(x, 1, dv)
    return x


def to_gguf(name: str, x: np.ndarray, cfg: Qwen3_5Config) -> np.ndarray:
    """An HF tensor -> the array llama.cpp's converter stores for it (float32)."""
    x = np.asarray(x, np.float32)
    if name.endswith("conv1d.weight"):
        x = x[:, 0, :]
    if arch_of(cfg) in TILED_V_HEADS:
        x = reorder_gdn(name, x, cfg, to_tiled=True)
    if name.endswith("A_log"):
        x = -np.exp(x)
    return x + 1.0 if is_shifted_norm(name) else x


def from_gguf(name: str, x: np.ndarray, cfg: Qwen3_5Config, where: str) -> np.ndarray:
    """Undo `to_gguf`: a dequantized GGUF tensor -> the HF tensor (float32). `where` names the
    GGUF tensor in errors."""
    if name.endswith("A_log"):
        if not (x < 0).all():
            raise CheckpointError(f"{where} must hold -exp(A_log) < 0 but has values >= 0; the file is corrupt "
                                  f"or was written by a converter that applied the transform twice")
        x = np.log(-x.astype(np.float64)).astype(np.float32)
    if is_shifted_norm(name):
        x = x - 1.0
    if arch_of(cfg) in TILED_V_HEADS:
        x = reorder_gdn(name, x, cfg, to_tiled=False)
    return x[:, None, :] if name.endswith("conv1d.weight") else x


# ----------------------------------------------------------------------------- reading


def open_gguf(path: Path) -> gguf.GGUFReader:
    """gguf-py's reader over `path`, with every tensor's data checked to lie inside the file,
    aligned and without overlapping another's. Raises CheckpointError naming the file."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError) as e:
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(f"cannot read GGUF file {path} ({size} bytes): {e} (not a GGUF file, a wrong magic, "
                              f"or truncated?)") from None
    size = reader.data.shape[0]
    spans = sorted((t.data_offset, t.data_offset + int(t.n_bytes), t.name) for t in reader.tensors)
    for (start, end, name), nxt in zip(spans, spans[1:] + [(size, size, None)]):
        if (start - reader.data_offset) % reader.alignment:
            raise CheckpointError(f"{path}: tensor {name!r} starts at byte {start}, not aligned to "
                                  f"{reader.alignment}; the tensor offsets are corrupt")
        if end > nxt[0]:
            what = "runs past the end of the file (truncated?)" if nxt[2] is None else f"overlaps tensor {nxt[2]!r}"
            raise CheckpointError(f"{path}: tensor {name!r} (bytes {start}..{end}) {what}; the file is corrupt")
    return reader


def metadata(reader: gguf.GGUFReader, path: Path, key: str, default=...):
    """A metadata value (int, float, str or list), or `default`; a missing required key raises."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise CheckpointError(f"{path} has no metadata key {key!r}, which a Qwen3.5/Next GGUF needs")
        return default
    try:
        value = field.contents()
    except (ValueError, IndexError, TypeError) as e:  # UnicodeDecodeError too: a flipped bit in a string
        raise CheckpointError(f"{path}: metadata key {key!r} cannot be read ({type(e).__name__}: {e}); the "
                              f"file's header is corrupt") from None
    return float(str(np.float32(value))) if isinstance(value, float) else value  # 1e-06, not 9.99999997e-07


def metadata_count(reader: gguf.GGUFReader, path: Path, key: str, default=..., *, positive: bool = False):
    """A metadata integer, >= 1 if positive else >= 0 (or `default` when the key is absent and a
    default is given); CheckpointError naming the file and key for any other value."""
    value = metadata(reader, path, key, default)
    if default is not ... and value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise CheckpointError(f"{path}: metadata {key} = {value!r} must be "
                              f"{'a positive integer' if positive else 'an integer >= 0'}")
    return value


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> Qwen3_5Config:
    """The GGUF's metadata as the config `Qwen3_5Config.from_hf` builds from a config.json; the MTP
    head is kept only when the file has its nextn block."""
    arch = metadata(reader, path, "general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(f"{path} has general.architecture {arch!r}; spec_jax loads {', '.join(ARCHS)}")
    get = lambda key, default=...: metadata(reader, path, key.format(arch=arch), default)  # noqa: E731

    def count(key: str, default=..., positive: bool = False):
        return metadata_count(reader, path, key.format(arch=arch), default, positive=positive)

    K = gguf.Keys
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path} is missing tensor 'token_embd.weight'")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    nextn = count(K.LLM.NEXTN_PREDICT_LAYERS, 0)
    n_layers = count(K.LLM.BLOCK_COUNT) - nextn
    has_nextn = nextn > 0 and gguf.TENSOR_NAMES[NEXTN["mtp.fc.weight"]].format(bid=n_layers) + ".weight" in names
    head_dim, v_heads = count(K.Attention.KEY_LENGTH, positive=True), count(K.SSM.TIME_STEP_RANK, positive=True)
    eos = [count(key, None) for key in (K.Tokenizer.EOS_ID, K.Tokenizer.EOT_ID, K.Tokenizer.EOM_ID)]
    hf = {
        "model_type": MODEL_TYPES[arch], "vocab_size": int(embed.shape[1]), "hidden_size": get(K.LLM.EMBEDDING_LENGTH),
        "intermediate_size": get(K.LLM.FEED_FORWARD_LENGTH, None), "num_hidden_layers": n_layers,
        "num_attention_heads": get(K.Attention.HEAD_COUNT), "num_key_value_heads": get(K.Attention.HEAD_COUNT_KV),
        "head_dim": head_dim, "rms_norm_eps": get(K.Attention.LAYERNORM_RMS_EPS),
        "rope_theta": get(K.Rope.FREQ_BASE), "partial_rotary_factor": count(K.Rope.DIMENSION_COUNT) / head_dim,
        "max_position_embeddings": get(K.LLM.CONTEXT_LENGTH), "tie_word_embeddings": "output.weight" not in names,
        "full_attention_interval": get(K.LLM.FULL_ATTENTION_INTERVAL),
        "linear_conv_kernel_dim": get(K.SSM.CONV_KERNEL), "linear_key_head_dim": get(K.SSM.STATE_SIZE),
        "linear_num_key_heads": get(K.SSM.GROUP_COUNT), "linear_num_value_heads": v_heads,
        "linear_value_head_dim": count(K.SSM.INNER_SIZE) // v_heads,
        "num_experts": get(K.LLM.EXPERT_COUNT, 0), "num_experts_per_tok": get(K.LLM.EXPERT_USED_COUNT, 0),
        "moe_intermediate_size": get(K.LLM.EXPERT_FEED_FORWARD_LENGTH, 0),
        "shared_expert_intermediate_size": get(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
        "norm_topk_prob": bool(get(K.LLM.EXPERT_WEIGHTS_NORM, True)),
        "mtp_num_hidden_layers": nextn if has_nextn else 0,
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
        "bos_token_id": get(K.Tokenizer.BOS_ID, None),
    }
    for key in ("num_key_value_heads", "num_attention_heads"):
        if not isinstance(hf[key], int):
            raise CheckpointError(f"{path}: per-layer {key} {hf[key]} is not supported; expected one count")
    try:
        return Qwen3_5Config.from_hf(hf)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: its metadata does not describe a valid model: {e}") from None


def dequantize(tensor, path: Path) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (PyTorch) order, through gguf-py's own dequantize."""
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    try:
        x = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} has type {qtype.name}, which gguf-py cannot "
                              f"dequantize; re-quantize the model to F16, BF16, Q8_0 or a K-quant") from None
    x = np.asarray(x, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if not np.isfinite(x).all():
        raise CheckpointError(f"{path}: tensor {tensor.name!r} ({qtype.name}) holds NaN or inf; the file is corrupt")
    return x


class GGUFSource:
    """Every tensor of a GGUF file by text-only HF name (the `checkpoint.TensorSource` interface),
    dequantized and with the converter's transforms undone. `cfg` is the file's config."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.cfg = config_from_gguf(self.reader, self.path)
        self.arch = arch_of(self.cfg)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.tensor_map = gguf.get_tensor_name_map(ARCHS[self.arch], self.cfg.num_hidden_layers + 1)

    def names_for(self, name: str) -> list[str] | None:
        """The GGUF tensors holding `name`; routed experts may be stored split or fused."""
        fused = gguf_names(name, self.arch, self.cfg.num_hidden_layers, self.tensor_map, fused_experts=True)
        if name.endswith("experts.gate_up_proj") and fused and fused[0] in self.tensors:
            return fused
        return gguf_names(name, self.arch, self.cfg.num_hidden_layers, self.tensor_map)

    def __contains__(self, name: str) -> bool:
        names = self.names_for(name)
        return names is not None and all(n in self.tensors for n in names)

    def get(self, name: str) -> np.ndarray:
        names = self.names_for(name)
        if names is None:
            raise CheckpointError(f"a {self.arch} GGUF has no tensor for {name!r}")
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise CheckpointError(f"{self.path} is missing tensor {missing[0]!r} (the model's {name!r})")
        parts = [dequantize(self.tensors[n], self.path) for n in names]
        x = np.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]  # experts: gate rows, then up rows
        return from_gguf(name, x, self.cfg, f"{self.path}: tensor {names[0]!r}")

    def read(self, name: str) -> np.ndarray:
        """`get` for names this architecture stores; the rest (qwen3next's split in_proj_a/b)
        are rebuilt from the tensors it does store by checkpoint.read_tensor."""
        return self.get(name) if self.names_for(name) is not None else read_tensor(self, name, self.cfg)


def load_gguf(path: str | os.PathLike, dtype, *, progress: bool | None = None, placement=None):
    """A GGUF target -> (Qwen3_5Model, Qwen3_5Config); dtype and placement as in
    `safetensors.load_params`."""
    src = GGUFSource(path)
    cfg = src.cfg
    model = fill_params(lambda: Qwen3_5Model(cfg, dtype=dtype), src,
                        lambda p: (param_sources(p, cfg), is_stacked(p)), src.read, progress=progress,
                        placement=placement)
    return model, cfg


# ----------------------------------------------------------------------------- tokenizer


class GGUFTokenizer(Tokenizer):
    """The `Tokenizer` interface over a `tokenizers.Tokenizer` built in memory."""

    def __init__(self, hf):
        self.hf = hf


def gguf_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer for a GGUF target: `tokenizer.json` beside the file if there is one, else
    the byte-level BPE vocabulary the GGUF carries (`tokenizer.ggml.*`, model "gpt2") when its
    pre-tokenizer is one this loader knows (qwen35, qwen2, gpt2). None otherwise: then put the
    model's tokenizer.json next to the .gguf, or pass prompt token ids."""
    path = Path(path)
    beside = path.parent / "tokenizer.json"
    if beside.exists():
        return Tokenizer(beside)
    try:
        return tokenizer_from_metadata(open_gguf(path), path)
    except CheckpointError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception for a vocabulary it cannot build
        raise CheckpointError(f"{path}: its tokenizer metadata does not build a tokenizer ({e}); put the "
                              f"model's tokenizer.json next to the file") from None


def tokenizer_from_metadata(reader: gguf.GGUFReader, path: Path) -> Tokenizer | None:
    """`gguf_tokenizer`'s rebuild from `tokenizer.ggml.*`, or None for a vocabulary it does not know."""
    get = lambda key: metadata(reader, path, key, None)  # noqa: E731
    K = gguf.Keys.Tokenizer
    pre = get(K.PRE)
    if get(K.MODEL) != "gpt2" or not (pre in PRE_TOKENIZER_PATTERNS or pre in GPT2_PRE_TOKENIZERS):
        return None
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens, types = get(K.LIST), get(K.TOKEN_TYPE) or []
    merges = [tuple(m.split(" ", 1)) for m in get(K.MERGES) or []]
    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre in PRE_TOKENIZER_PATTERNS:
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    kinds = {gguf.TokenType.CONTROL: True, gguf.TokenType.USER_DEFINED: False}  # -> special?
    added = [AddedToken(tokens[i], special=kinds[t], normalized=False) for i, t in enumerate(types) if t in kinds]
    hf.add_special_tokens([a for a in added if a.special])
    hf.add_tokens([a for a in added if not a.special])
    return GGUFTokenizer(hf)
