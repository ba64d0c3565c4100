"""The training corpus: text every machine with Python has.

* code: every `*.py` file of the Python standard library (tests included, site-packages
  excluded), in sorted order of its path relative to the stdlib root;
* prose: the documentation text a Python install carries: the reference-manual topics of
  `pydoc_data/topics.py`, the docstrings of the standard library's modules, classes and
  functions (one document per source file), and its plain-text files outside the test suite
  (LICENSE.txt, idlelib's help and news).

A document is held out when a stable hash of its source path falls in the first
`HELDOUT_PERCENT` of 100 buckets, so a file's code and its docstrings land in the same split.
Documents are tokenized and joined into one token stream per (kind, split), each document
followed by EOS; the streams and the tokenizer are cached together in one `.npz` file.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import sysconfig
import warnings
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from spec_jax.default_model import train_tokenizer

HELDOUT_PERCENT = 4
EOS, IM_START, MASK = "<|im_end|>", "<|im_start|>", "<|mask|>"
SPECIALS = (EOS, IM_START, MASK)  # ids 0, 1, 2: EOS (and document separator), chat turn start, DFlash mask
KINDS = ("code", "prose")
SPLITS = ("train", "heldout")
MIN_DOCSTRING_CHARS = 80  # one-liners ("Return self.") teach nothing
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Document:
    source: str  # the stdlib-relative path the split is decided by
    kind: str  # "code" | "prose"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(source: str) -> bool:
    """Stable across runs and machines: the first 8 hex digits of sha256(path) modulo 100."""
    return int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def stdlib_files(root: Path, suffix: str) -> list[Path]:
    return sorted((p for p in root.rglob(f"*{suffix}") if "site-packages" not in p.parts),
                  key=lambda p: p.relative_to(root).as_posix())


def docstrings(source: str) -> list[str]:
    """The module, class and function docstrings of one Python source, in file order."""
    try:
        with warnings.catch_warnings():  # old sources' invalid escapes warn on parse
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source)
    except (SyntaxError, ValueError):  # the test suite holds deliberately broken files
        return []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef))]
    found = [(getattr(n, "lineno", 0), ast.get_docstring(n)) for n in nodes]
    return [d for _, d in sorted(found, key=lambda x: x[0]) if d and len(d) >= MIN_DOCSTRING_CHARS]


def documents(root: Path | None = None):
    """Every document, in a fixed order: the pydoc topics, the plain-text files, then each
    source file's code followed by its docstrings (a generator: parsing 30 MB takes a while)."""
    import pydoc_data.topics

    root = root or stdlib_root()
    for name, text in sorted(pydoc_data.topics.topics.items()):
        yield Document(f"pydoc_data/topics.py#{name}", "prose", text.strip())
    for p in stdlib_files(root, ".txt"):
        rel = p.relative_to(root).as_posix()
        if not rel.startswith(("test/", "idlelib/idle_test/")):
            yield Document(rel, "prose", p.read_text(errors="replace"))
    for p in stdlib_files(root, ".py"):
        rel, text = p.relative_to(root).as_posix(), p.read_text(errors="replace")
        yield Document(rel, "code", text)
        found = docstrings(text)
        if found:
            yield Document(rel, "prose", "\n\n".join(found))


def split_documents(limit_chars: int | None = None) -> dict[tuple[str, str], list[Document]]:
    """Documents by (kind, split), split "train" or "heldout". With limit_chars, each training
    part stops at that size and each held-out part at a tenth of it."""
    parts = {(kind, split): [] for kind in KINDS for split in SPLITS}
    sizes = dict.fromkeys(parts, 0)
    cap = lambda split: None if limit_chars is None else (limit_chars // 10 if split == "heldout" else limit_chars)
    for doc in documents():
        key = (doc.kind, "heldout" if is_heldout(doc.source) else "train")
        if cap(key[1]) is not None and sizes[key] >= cap(key[1]):
            if all(sizes[k] >= cap(k[1]) for k in parts):
                break
            continue
        parts[key].append(doc)
        sizes[key] += len(doc.text)
    return parts


def tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json: EOS, the special tokens and a Qwen-style chat template."""
    added = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for i, t in enumerate(SPECIALS)}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
            "unk_token": None, "model_max_length": max_length, "added_tokens_decoder": added,
            "chat_template": CHAT_TEMPLATE}


def token_stream(tok: Tokenizer, docs: list[Document]) -> np.ndarray:
    """The documents' token ids, each followed by EOS (id 0), as one uint16 array."""
    ids = [e.ids for e in tok.encode_batch([d.text for d in docs], add_special_tokens=False)]
    eos = tok.token_to_id(EOS)
    flat = [t for doc in ids for t in (*doc, eos)]
    return np.asarray(flat, np.uint16)


@dataclasses.dataclass
class Corpus:
    """Token streams by (kind, split), e.g. streams["code", "train"], and the tokenizer."""

    streams: dict[tuple[str, str], np.ndarray]
    tokenizer_json: str

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.tokenizer_json)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def build_corpus(path: str | Path, vocab_size: int, limit_chars: int | None = None) -> Corpus:
    """Split the documents, train the BPE on the training split, tokenize every split and save
    all of it to `path` (.npz). limit_chars caps each (kind, train) part (held-out: a tenth)."""
    if vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab_size {vocab_size} does not fit the uint16 token streams (at most 65535)")
    parts = split_documents(limit_chars)
    empty = [k for k, v in parts.items() if not v]
    if empty:
        raise ValueError(f"the corpus has no {empty[0][0]} documents in its {empty[0][1]} split; "
                         f"raise limit_chars ({limit_chars})")
    train_texts = [d.text for kind in KINDS for d in parts[kind, "train"]]
    tok = train_tokenizer(vocab_size, texts=train_texts, specials=SPECIALS)
    corpus = Corpus({k: token_stream(tok, v) for k, v in parts.items()}, tok.to_str())
    save_corpus(corpus, path)
    return corpus


def save_corpus(corpus: Corpus, path: str | Path) -> None:
    arrays = {f"{kind}_{split}": a for (kind, split), a in corpus.streams.items()}
    np.savez(path, tokenizer_json=np.frombuffer(corpus.tokenizer_json.encode(), np.uint8), **arrays)


def load_corpus(path: str | Path) -> Corpus:
    """A corpus saved by `build_corpus`; raises ValueError naming the file if it is not one."""
    try:
        with np.load(path) as f:
            streams = {(kind, split): f[f"{kind}_{split}"] for kind in KINDS for split in SPLITS}
            tok_json = f["tokenizer_json"].tobytes().decode()
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{str(path)!r} is not a corpus written by spec_jax.training.corpus: {e}") from None
    json.loads(tok_json)
    return Corpus(streams, tok_json)


def heldout_texts(kind: str, limit_chars: int | None = None) -> list[str]:
    """The held-out documents of one kind as text (evaluation prompts); limit_chars as in
    `split_documents`, a tenth of it for held-out."""
    return [d.text for d in split_documents(limit_chars)[kind, "heldout"]]


def main(argv: list[str] | None = None) -> None:
    """Build the tokenized corpus: python -m spec_jax.training.corpus OUT.npz [--vocab 8192]."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m spec_jax.training.corpus", description=main.__doc__)
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--limit-chars", type=int, default=None, help="cap each kind's training text (tests)")
    args = ap.parse_args(argv)
    corpus = build_corpus(args.out, args.vocab, args.limit_chars)
    for (kind, split), a in corpus.streams.items():
        print(f"{kind:5s} {split:7s} {len(a):>10,d} tokens")


if __name__ == "__main__":
    main()
