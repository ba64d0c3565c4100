"""The training corpus: the text of the Python installation that runs the build, which is all a
machine without internet access (the GPU machine) has.

* code: the `*.py` files of the standard library (its tests included) and of every installed
  package (site-packages); generated files (over `MAX_FILE_CHARS`, or a line over
  `MAX_LINE_CHARS`) and exact duplicates (vendored copies) are skipped, and each top-level
  package gives at most `PACKAGE_CAP_CHARS` of code, its files taken in hash order so that a
  large package is sampled evenly rather than alphabetically;
* prose: the reference-manual topics of `pydoc_data/topics.py`, the docstrings of every kept
  source file's modules, classes and functions (one document per file), the packages' long
  descriptions (the body of `*.dist-info/METADATA`) and their plain-text, Markdown and reST
  files (licences and packaging records excluded), and the standard library's text files outside
  its test suite.

A document is held out when a stable hash of its source name (`stdlib/...` or
`site-packages/...`) falls in the first `HELDOUT_PER_MILLE` of 1000 buckets, so a file's code and
its docstrings land in the same split. Documents are tokenized and joined into one token stream
per (kind, split), each document followed by EOS; the streams and the tokenizer are cached
together in one `.npz` file. Files are read and parsed by a pool of worker processes.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import sysconfig
import warnings
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from spec_jax.default_model import train_tokenizer

HELDOUT_PER_MILLE = 10
EOS, IM_START, MASK = "<|im_end|>", "<|im_start|>", "<|mask|>"
SPECIALS = (EOS, IM_START, MASK)  # ids 0, 1, 2: EOS (and document separator), chat turn start, DFlash mask
KINDS = ("code", "prose")
SPLITS = ("train", "heldout")
MIN_DOCSTRING_CHARS = 80  # one-liners ("Return self.") teach nothing
MAX_FILE_CHARS = 400_000  # past this a source is a generated table, not code anyone wrote
MAX_LINE_CHARS = 2_000  # minified or embedded data
PACKAGE_CAP_CHARS = 24_000_000  # so that no one package (torch, transformers) becomes the corpus
MIN_LETTER_SHARE = 0.6  # a text file whose non-space characters are mostly not letters is data
TEXT_SUFFIXES = (".md", ".rst", ".txt")
NOT_PROSE = re.compile(r"licen[cs]e|copying|notice|authors|record|top_level|entry_points|requirements|sources|"
                       r"dependency_links|installer|requested|wheel|namespace_packages|not-zip-safe", re.IGNORECASE)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Document:
    source: str  # the name the split is decided by: "stdlib/<path>" or "site-packages/<path>"
    kind: str  # "code" | "prose"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def package_roots() -> list[Path]:
    """This interpreter's site-packages folders (purelib, platlib), each once."""
    paths = sysconfig.get_paths()
    roots = [Path(paths[k]).resolve() for k in ("purelib", "platlib") if Path(paths[k]).is_dir()]
    return list(dict.fromkeys(roots))


def stable_bucket(name: str, buckets: int) -> int:
    """Stable across runs and machines: the first 8 hex digits of sha256(name) modulo `buckets`."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % buckets


def is_heldout(source: str) -> bool:
    return stable_bucket(source, 1000) < HELDOUT_PER_MILLE


def docstrings(source: str) -> list[str]:
    """The module, class and function docstrings of one Python source, in file order."""
    try:
        with warnings.catch_warnings():  # old sources' invalid escapes warn on parse
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the test suites hold deliberately broken files
        return []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef))]
    found = [(getattr(n, "lineno", 0), ast.get_docstring(n)) for n in nodes]
    return [d for _, d in sorted(found, key=lambda x: x[0]) if d and len(d) >= MIN_DOCSTRING_CHARS]


def is_generated(text: str) -> bool:
    return len(text) > MAX_FILE_CHARS or any(len(line) > MAX_LINE_CHARS for line in text.splitlines())


def looks_like_prose(text: str) -> bool:
    chars = [c for c in text[:20_000] if not c.isspace()]
    return bool(chars) and sum(c.isalpha() for c in chars) >= MIN_LETTER_SHARE * len(chars)


def metadata_body(text: str) -> str:
    """A METADATA file's long description: what follows its header block."""
    header, _, body = text.partition("\n\n")
    return body.strip() if header.startswith("Metadata-Version") else ""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file to read: its source name, path and what it gives ("code": code and docstrings,
    "text": prose, "metadata": a METADATA body as prose)."""

    source: str
    path: Path
    role: str


def read_file(f: SourceFile) -> list[Document]:
    """The documents of one file (a worker's job); [] for a file the rules above skip."""
    text = f.path.read_text(errors="replace")
    if f.role == "metadata":
        body = metadata_body(text)
        return [Document(f.source, "prose", body)] if len(body) >= MIN_DOCSTRING_CHARS else []
    if is_generated(text):
        return []
    if f.role == "text":
        return [Document(f.source, "prose", text)] if looks_like_prose(text) else []
    found = docstrings(text)
    return [Document(f.source, "code", text)] + ([Document(f.source, "prose", "\n\n".join(found))] if found else [])


def stdlib_sources(root: Path) -> list[SourceFile]:
    """The standard library's sources and text files (outside its tests), site-packages excluded."""
    def files(suffix):
        return sorted((p for p in root.rglob(f"*{suffix}") if "site-packages" not in p.relative_to(root).parts),
                      key=lambda p: p.relative_to(root).as_posix())

    out = []
    for p in files(".txt"):
        rel = p.relative_to(root).as_posix()
        if not rel.startswith(("test/", "idlelib/idle_test/")):
            out.append(SourceFile(f"stdlib/{rel}", p, "text"))
    return out + [SourceFile(f"stdlib/{p.relative_to(root).as_posix()}", p, "code") for p in files(".py")]


def package_sources(root: Path) -> list[SourceFile]:
    """One site-packages folder's sources (at most PACKAGE_CAP_CHARS of code per top-level name,
    in hash order), docs and METADATA bodies, in path order."""
    by_package: dict[str, list[Path]] = {}
    texts, metadata = [], []
    for p in root.rglob("*"):
        parts = p.relative_to(root).parts
        if "__pycache__" in parts or not p.is_file():
            continue
        if p.suffix == ".py":
            by_package.setdefault(parts[0], []).append(p)
        elif parts[0].endswith(".dist-info") and p.name == "METADATA":
            metadata.append(p)
        elif p.suffix in TEXT_SUFFIXES and not NOT_PROSE.search(p.name) and not parts[0].endswith(".dist-info"):
            texts.append(p)
    code = []
    for paths in by_package.values():
        size = 0
        for p in sorted(paths, key=lambda p: stable_bucket(p.relative_to(root).as_posix(), 1 << 30)):
            size += p.stat().st_size
            if size > PACKAGE_CAP_CHARS:
                break
            code.append(p)
    def name(p):
        return f"site-packages/{p.relative_to(root).as_posix()}"
    files = [SourceFile(name(p), p, "text") for p in texts] + [SourceFile(name(p), p, "metadata") for p in metadata]
    return sorted(files + [SourceFile(name(p), p, "code") for p in code], key=lambda f: f.source)


def documents(workers: int | None = None):
    """Every document, in a fixed order: the pydoc topics, then the standard library's files, then
    each site-packages folder's; exact duplicates of an earlier document of the same kind are
    dropped (a generator: files are read by `workers` processes, default one per CPU)."""
    import pydoc_data.topics

    for name, text in sorted(pydoc_data.topics.topics.items()):
        yield Document(f"stdlib/pydoc_data/topics.py#{name}", "prose", text.strip())
    files = stdlib_sources(stdlib_root())
    stdlib = stdlib_root().resolve()
    for root in package_roots():
        if not root.is_relative_to(stdlib):
            files += package_sources(root)
    seen = set()
    with multiprocessing.get_context("fork").Pool(workers or os.cpu_count()) as pool:
        for docs in pool.imap(read_file, files, chunksize=32):
            for doc in docs:
                digest = hashlib.sha256(f"{doc.kind}\0{doc.text}".encode()).digest()
                if digest not in seen:
                    seen.add(digest)
                    yield doc


def split_documents(limit_chars: int | None = None) -> dict[tuple[str, str], list[Document]]:
    """Documents by (kind, split), split "train" or "heldout". With limit_chars, each training
    part stops at that size and each held-out part at a tenth of it."""
    parts = {(kind, split): [] for kind in KINDS for split in SPLITS}
    sizes = dict.fromkeys(parts, 0)
    def cap(split):
        return None if limit_chars is None else (limit_chars // 10 if split == "heldout" else limit_chars)
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


def token_stream(tok: Tokenizer, docs: list[Document], chunk: int = 4096) -> np.ndarray:
    """The documents' token ids, each followed by EOS (id 0), as one uint16 array (encoded
    `chunk` documents at a time: a whole corpus of Encodings would not fit in memory)."""
    eos = np.asarray([tok.token_to_id(EOS)], np.uint16)
    arrays = []
    for s in range(0, len(docs), chunk):
        for e in tok.encode_batch([d.text for d in docs[s:s + chunk]], add_special_tokens=False):
            arrays += [np.asarray(e.ids, np.uint16), eos]
    return np.concatenate(arrays) if arrays else np.zeros((0,), np.uint16)


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

    def heldout_only(self) -> Corpus:
        """The same corpus with empty training streams: what evaluation needs, a few MB."""
        return Corpus({(k, s): a if s == "heldout" else a[:0] for (k, s), a in self.streams.items()},
                      self.tokenizer_json)


def build_corpus(path: str | Path, vocab_size: int, limit_chars: int | None = None,
                 tokenizer_json: str | None = None) -> Corpus:
    """Split the documents, train the BPE on the training split (or use `tokenizer_json`, whose
    first ids must be SPECIALS), tokenize every split and save all of it to `path` (.npz).
    limit_chars caps each (kind, train) part (held-out: a tenth)."""
    if vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab_size {vocab_size} does not fit the uint16 token streams (at most 65535)")
    parts = split_documents(limit_chars)
    empty = [k for k, v in parts.items() if not v]
    if empty:
        raise ValueError(f"the corpus has no {empty[0][0]} documents in its {empty[0][1]} split; "
                         f"raise limit_chars ({limit_chars})")
    if tokenizer_json is None:
        tok = train_tokenizer(vocab_size, texts=[d.text for kind in KINDS for d in parts[kind, "train"]],
                              specials=SPECIALS)
    else:
        tok = Tokenizer.from_str(tokenizer_json)
        if [tok.token_to_id(t) for t in SPECIALS] != list(range(len(SPECIALS))):
            raise ValueError(f"the given tokenizer does not hold {SPECIALS} as ids 0..{len(SPECIALS) - 1}")
    corpus = Corpus({k: token_stream(tok, v) for k, v in parts.items()}, tok.to_str())
    save_corpus(corpus, path)
    return corpus


def save_corpus(corpus: Corpus, path: str | Path, compressed: bool = False) -> None:
    """compressed: zlib, for a file that travels (slow to write at full size)."""
    arrays = {f"{kind}_{split}": a for (kind, split), a in corpus.streams.items()}
    save = np.savez_compressed if compressed else np.savez
    save(path, tokenizer_json=np.frombuffer(corpus.tokenizer_json.encode(), np.uint8), **arrays)


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


def training_prompts(corpus: Corpus, n: int, length: int, prose_fraction: float, seed: int = 0) -> np.ndarray:
    """n random windows of `length` tokens of the training streams, a `prose_fraction` share from
    prose: [n, length] uint16."""
    rng = np.random.default_rng(seed)
    n_prose = int(round(n * prose_fraction))
    out = []
    for kind, count in (("code", n - n_prose), ("prose", n_prose)):
        stream = corpus.streams[kind, "train"]
        starts = rng.integers(0, len(stream) - length, count)
        out.append(np.stack([stream[s:s + length] for s in starts]) if count else np.zeros((0, length), np.uint16))
    return np.concatenate(out)[rng.permutation(n)]


def heldout_texts(kind: str, limit_chars: int | None = None) -> list[str]:
    """The held-out documents of one kind as text (evaluation prompts); limit_chars as in
    `split_documents`, a tenth of it for held-out."""
    return [d.text for d in split_documents(limit_chars)[kind, "heldout"]]


def main(argv: list[str] | None = None) -> None:
    """Build the tokenized corpus: python -m spec_jax.training.corpus OUT.npz [--vocab 8192 | --tokenizer T.json]."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="python -m spec_jax.training.corpus", description=main.__doc__)
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of training one")
    ap.add_argument("--heldout-out", default=None, help="also write the held-out streams alone here (.npz)")
    ap.add_argument("--limit-chars", type=int, default=None, help="cap each kind's training text (tests)")
    ap.add_argument("--prompts-out", default=None,
                    help="also write --prompts random training windows of --prompt-len tokens here (.npy), "
                         "the prompts the drafters' greedy continuations start from (train.py --prompts)")
    ap.add_argument("--prompts", type=int, default=24576)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prose-fraction", type=float, default=0.25)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tok_json = Path(args.tokenizer).read_text() if args.tokenizer else None
    corpus = build_corpus(args.out, args.vocab, args.limit_chars, tok_json)
    if args.heldout_out:
        save_corpus(corpus.heldout_only(), args.heldout_out, compressed=True)
    if args.prompts_out:
        np.save(args.prompts_out, training_prompts(corpus, args.prompts, args.prompt_len, args.prose_fraction))
    for (kind, split), a in corpus.streams.items():
        print(f"{kind:5s} {split:7s} {len(a):>12,d} tokens")
    print(f"built in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
