"""`EngineConfig`: every engine option in one frozen, hashable dataclass, checked once, here.

The front ends turn their argument forms into it (`spec_jax.api.llm.LLM` takes vLLM's); the engine
reads nothing else. Fields that depend on the model are resolved by `for_model` once it is loaded:
max_model_len defaults to the model's limit (at most 4096) and is checked against it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_chunked import CHUNK
from models.qwen3_5 import ROLLBACKS, STATE_DTYPES, Qwen3_5Config, check_state_dtype
from spec_jax.engine.params import INT32_MAX, check_int
from spec_jax.engine.reasoning_grammar import REASONING_PARSERS
from spec_jax.engine.spec_config import SpeculativeConfig, check_mtp_head

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_PREFIX_CACHE_BYTES = 4 * 10**9
# How the networks hold their layers: "decode" (every layer's weights arrays of their own, run
# unrolled, same-input projections joined: `Qwen3_5Model.use_decode_layout`), "unfused" (the same
# with every projection its own matmul), "rolled" (the loaded [G, ...] stacks under a rolled scan).
LAYOUTS = ("decode", "unfused", "rolled")
# vLLM's mamba_ssm_cache_dtype values: "auto" is the checkpoint's mamba_ssm_dtype.
MAMBA_SSM_CACHE_DTYPES = ("auto", *STATE_DTYPES)


def default_decode_layout() -> bool:
    """Whether the layout defaults to "decode": on the GPU, where XLA copies weights sliced out of
    a stack inside the decode loop; elsewhere the stacked, rolled layout compiles faster and runs alike."""
    return jax.default_backend() == "gpu"


def cache_length(max_model_len: int, block_size: int | None = None) -> int:
    """Cache slots of an engine: max_model_len rounded up to the GDN chunk, or to the prefix
    cache's block size (a block pass writes whole blocks)."""
    unit = block_size or CHUNK
    return -(-max_model_len // unit) * unit


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine option.

    max_model_len: the longest prompt + completion; it sizes the caches (None until `for_model`).
    max_num_seqs: batch rows per step. batch_buckets: the row counts programs are compiled for
      (kept sorted; a batch runs padded to the smallest that holds it, max_num_seqs always one; None:
      powers of two).
    compiler_options: XLA options of every program, as (name, value) pairs.
    layout: one of `LAYOUTS` (None: "decode" on the GPU, "rolled" elsewhere).
    tensor_parallel_size: devices the target is split over.
    enable_prefix_caching, prefix_block_size, prefix_cache_bytes, prefix_cache_host_bytes: the prefix
      store (`prefix_cache.PrefixCache`): tokens a block holds (None: 256 on the GPU or the cache's
      length if shorter, CHUNK elsewhere), device bytes it may hold (None: what
      gpu_memory_utilization leaves beside the batch's caches when that is given, else 4 GB),
      host bytes for blocks the device evicts.
    batch_invariant: trace the target batch-invariant (`pallas_kernels.batch_invariant`).
    rollback: how GDN state returns to the accepted prefix, "checkpoint" or "replay".
    mamba_ssm_cache_dtype: vLLM's engine argument, the dtype the GDN recurrent state is cached in:
      "auto" (the checkpoint's `mamba_ssm_dtype`, float32 in Qwen's) or one of `STATE_DTYPES`; a
      16-bit state halves the bytes a decode step streams per row (the math stays float32).
    speculative: the parsed speculative config (None: plain decoding).
    seed: base seed of requests that set none.
    gpu_memory_utilization: size max_num_seqs to this share of the device's memory (None: as given).
    grammar_drafts: in a constrained row, draft the tokens its grammar forces (and EOS once it ended)
      where the proposer has none or drafted a forbidden one (`grammar_rows`); off only to measure it.
    reasoning_parser: vLLM's engine argument, one of `REASONING_PARSERS` (None: no reasoning): a
      constrained row's grammar holds its answer, after the reasoning the prompt leaves it in
      (`reasoning_grammar`).
    """

    max_model_len: int | None = None
    max_num_seqs: int = 8
    batch_buckets: tuple[int, ...] | None = None
    compiler_options: tuple[tuple[str, Any], ...] = ()
    layout: str | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False
    prefix_block_size: int | None = None
    prefix_cache_bytes: int | None = None
    prefix_cache_host_bytes: int = 0
    batch_invariant: bool = False
    rollback: str = "replay"
    mamba_ssm_cache_dtype: str = "auto"
    speculative: SpeculativeConfig | None = None
    seed: int = 0
    gpu_memory_utilization: float | None = None
    grammar_drafts: bool = True
    reasoning_parser: str | None = None

    def __post_init__(self):
        check_int("max_num_seqs", self.max_num_seqs, 1, 4096, "must be between 1 and 4096")
        if self.batch_buckets is not None:
            for b in self.batch_buckets:
                check_int("a batch bucket", b, 1, self.max_num_seqs,
                          f"must be between 1 and max_num_seqs={self.max_num_seqs}")
            object.__setattr__(self, "batch_buckets", tuple(sorted({int(b) for b in self.batch_buckets})))
        self._check_compiler_options()
        check_state_dtype("mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, also=("auto",))
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"rollback={self.rollback!r}; expected one of {', '.join(ROLLBACKS)}")
        check_int("seed", self.seed, -(2**63), 2**63 - 1, "must fit in 64 bits")
        if self.layout is None:
            object.__setattr__(self, "layout", "decode" if default_decode_layout() else "rolled")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; expected one of {', '.join(LAYOUTS)}")
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 2**16, "must be a positive device count")
        for name in ("enable_prefix_caching", "batch_invariant", "grammar_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not built; accepted: None, "
                             f"{', '.join(map(repr, REASONING_PARSERS))}")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2, INT32_MAX, f"must be from 2 to {INT32_MAX}")
            self._check_prefix_block()
            self._check_speculation()

    def _check_compiler_options(self) -> None:
        """ValueError naming an option XLA does not know (found by compiling a one-op program with them)."""
        if not self.compiler_options:
            return
        options = dict(self.compiler_options)
        try:
            jax.jit(lambda x: x).lower(jnp.zeros(1)).compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(f"compiler_options={options!r}: XLA refused them ({e})") from None

    def _check_prefix_block(self) -> None:
        """A block is a multiple of CHUNK tokens no longer than the cache (max_model_len rounded up
        to CHUNK): a longer one could never fill, and the caches are sized to hold whole blocks.
        Checked with caching off too, so that a bad value is named when it is given."""
        longest = cache_length(self.max_model_len)
        if self.prefix_block_size is None:
            object.__setattr__(self, "prefix_block_size",
                               min(256, longest) if jax.default_backend() == "gpu" else CHUNK)
        size = self.prefix_block_size
        if isinstance(size, bool) or not isinstance(size, int) or not CHUNK <= size <= longest or size % CHUNK:
            raise ValueError(f"prefix_block_size={size!r} must be a positive multiple of {CHUNK} (the GDN chunk) "
                             f"up to {longest} (max_model_len={self.max_model_len} rounded up to one)")

    def _check_speculation(self) -> None:
        spec = self.speculative
        if spec is None:
            return
        if spec.num_speculative_tokens + 1 >= self.max_model_len:
            raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens} leaves no room in max_model_len="
                             f"{self.max_model_len}: a step verifies k + 1 tokens")
        if (spec.prompt_lookup_max or 0) >= self.max_model_len:
            raise ValueError(f"prompt_lookup_max={spec.prompt_lookup_max} must be below max_model_len="
                             f"{self.max_model_len}")

    def for_model(self, cfg: Qwen3_5Config, *, has_mtp: bool) -> "EngineConfig":
        """This config resolved against a loaded model: max_model_len defaulted to its limit (at
        most DEFAULT_MAX_MODEL_LEN) and checked against it; options the model cannot run refused."""
        limit = cfg.max_position_embeddings
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit) if self.max_model_len is None else self.max_model_len
        if not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be between 2 and the model's limit {limit}")
        if self.speculative is not None and self.speculative.method == "mtp":
            check_mtp_head(has_mtp)
        return dataclasses.replace(self, max_model_len=max_model_len)

    def state_dtype(self, cfg: Qwen3_5Config) -> str:
        """The GDN state's cache dtype for a model of config cfg: mamba_ssm_cache_dtype, "auto" read
        as the checkpoint's mamba_ssm_dtype."""
        return cfg.mamba_ssm_dtype if self.mamba_ssm_cache_dtype == "auto" else self.mamba_ssm_cache_dtype

    @property
    def cache_len(self) -> int:
        """Cache slots a row holds (`cache_length`)."""
        return cache_length(self.max_model_len, self.prefix_block_size if self.enable_prefix_caching else None)

    @property
    def xla_options(self) -> dict | None:
        """compiler_options as `jax.stages.Lowered.compile` takes them."""
        return dict(self.compiler_options) or None

    @property
    def k(self) -> int:
        """Most drafts per speculative step (0 without speculation); suffix decoding combined with a
        model drafter drafts up to the tree depth where the suffix wins."""
        spec = self.speculative
        if spec is None:
            return 0
        combined = spec.suffix_decoding_max_tree_depth if spec.enable_suffix_decoding else 0
        return max(spec.num_speculative_tokens, combined)
