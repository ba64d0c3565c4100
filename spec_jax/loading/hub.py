"""Where a checkpoint named as vLLM names it lives: a local path, or a Hugging Face repo id
("Qwen/Qwen3.6-27B") already in the local Hugging Face cache. Nothing is downloaded here."""

from __future__ import annotations

import os
from pathlib import Path


def hf_cache_dir() -> Path:
    """The hub cache folder Hugging Face's own tools use: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return Path(home) / "hub"


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of `repo_id` at `revision` (a branch or a commit), or None."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def local_checkpoint(name: str, what: str = "model") -> str:
    """`name` as a local path: itself if it exists, else the cached snapshot of the HF repo id it
    names. ValueError naming `what` (model, tokenizer) and both places looked in otherwise."""
    if not isinstance(name, str | os.PathLike):
        raise ValueError(f"{what} must be a path or a Hugging Face repo id, got {name!r}")
    name = str(name)
    if Path(name).exists():
        return name
    parts = name.split("/")
    if len(parts) == 2 and all(parts):
        snapshot = cached_snapshot(name)
        if snapshot is not None:
            return str(snapshot)
        where = hf_cache_dir() / f"models--{name.replace('/', '--')}"
        raise ValueError(f"{what} {name!r} is not a local path, and as a Hugging Face repo id it is not in the local "
                         f"cache ({where}); spec_jax downloads nothing: fetch it first (huggingface-cli download "
                         f"{name}) or pass its directory")
    raise ValueError(f"{what} {name!r} does not exist: pass a checkpoint directory or file, or a Hugging Face repo id "
                     f"('org/name') already in the local cache ({hf_cache_dir()})")
