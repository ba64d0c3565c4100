"""The embedded default model.

When the repo ships the trained checkpoint (`spec_jax/assets/default/`: a small Qwen3.5 target
with its MTP head, `dflash/` a DFlash drafter, `eagle3/` an EAGLE-3 head and `draft/` a Qwen3
draft model, trained by `python -m spec_jax.training.train` on the code and docs of a Python
installation: its standard library and site-packages), that is the default. Without
it, a small RANDOM-weight Qwen3.5 checkpoint in the released layout (VL-wrapped names, `mtp.*`
head, bf16 safetensors, config.json and a byte-level BPE `tokenizer.json` trained on the
standard library's source) is built on first use into `$SPEC_JAX_HOME/default-random-v1`
(default `~/.cache/spec_jax`), so every code path of a real checkpoint still runs; its text is noise.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.qwen3_5 import Qwen3_5Config
from spec_jax.writing.random_checkpoint import write_checkpoint

NAME = "default-random-v1"
ASSETS = Path(__file__).parent / "assets" / "default"  # the trained checkpoint, when shipped
VOCAB = 2048
EOS = "<|im_end|>"
DEFAULT_CONFIG = Qwen3_5Config(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
    max_position_embeddings=8192, tie_word_embeddings=False, mtp_num_hidden_layers=1,
    eos_token_id=(0,),
)


def home() -> Path:
    return Path(os.environ.get("SPEC_JAX_HOME", Path.home() / ".cache" / "spec_jax"))


def stdlib_text(limit_bytes: int = 2 << 20) -> list[str]:
    """Source files of Python's standard library: text every machine with Python has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="ignore")
        texts.append(text)
        size += len(text)
        if size > limit_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int = VOCAB, texts: list[str] | None = None, specials=(EOS,)) -> Tokenizer:
    """Byte-level BPE on `texts` (default: `stdlib_text()`), the special tokens first (EOS as id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_text() if texts is None else texts, trainer)
    return tok


def is_trained_default() -> bool:
    """Whether the trained default checkpoint ships with this install."""
    return (ASSETS / "config.json").exists()


def default_model_dir() -> Path:
    """The shipped trained checkpoint; without it the random fallback, built (a few seconds) the
    first time."""
    if is_trained_default():
        return ASSETS
    target = home() / NAME
    if (target / "config.json").exists():
        return target
    print(f"building the embedded default model (random weights) in {target} ...", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    write_checkpoint(tmp, DEFAULT_CONFIG, seed=0, dtype="bfloat16")
    train_tokenizer().save(str(tmp / "tokenizer.json"))
    try:
        tmp.rename(target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target
