"""vLLM's engine arguments as spec_jax reads them, so that a vLLM script runs with only its import
changed. `LLM(**kwargs)` and the CLI take vLLM's names; each argument is

* used: it means here what it means in vLLM (`LLM`'s own parameters, and those below that
  `EngineArgs.resolve` turns into values for it: `gpu_memory_utilization`, `quantization`);
* ignored: it has no counterpart in this engine. Accepted, and said once (a warning naming it and
  why), so that a script written for vLLM keeps running;
* refused: it asks for something this engine does not do (several devices, a KV-cache dtype). A
  ValueError names the value and what would be accepted.

An argument vLLM does not have either is a TypeError, as a misspelt keyword is in Python.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from spec_jax.loading.gguf import find_gguf
from spec_jax.loading.quantized import read_quant_scheme

# vLLM arguments with no counterpart here, and why.
IGNORED = {
    "enforce_eager": "spec_jax always runs ahead-of-time compiled XLA programs; there are no CUDA graphs to skip",
    "trust_remote_code": "the Qwen3.5/3.6 architectures are built in; no code from the checkpoint is run",
    "swap_space": "each row's caches live on the device for its whole request; nothing is swapped",
    "cpu_offload_gb": "weights are not offloaded to the host",
    "disable_custom_all_reduce": "XLA's collectives do the all-reduce; there is no custom one to turn off",
    "disable_log_stats": "the engine keeps no periodic stats log",
    "enable_chunked_prefill": "prompts are prefilled whole (the GDN kernel chunks them internally)",
    "max_num_batched_tokens": "prompts are prefilled whole; batches are sized by max_num_seqs",
    "block_size": "caches are contiguous per row, not paged",
    "tokenizer_mode": "one tokenizer implementation (HF tokenizers' tokenizer.json)",
    "revision": "checkpoints are read from local files",
    "tokenizer_revision": "checkpoints are read from local files",
    "code_revision": "checkpoints are read from local files",
    "download_dir": "checkpoints are read from local files",
    "load_format": "the format is detected from the files",
    "compilation_config": "XLA compiles every program; there is no separate compilation level",
    "max_seq_len_to_capture": "there are no CUDA graphs",
    "distributed_executor_backend": "one process drives every device of the mesh (jax.distributed across hosts)",
    "hf_token": "checkpoints are read from local files",
    "disable_log_requests": "requests are not logged",
    "limit_mm_per_prompt": "the models here read text only",
    "mm_processor_kwargs": "the models here read text only",
    "max_logprobs": "a request may ask for up to 20 logprobs (vLLM's default), a fixed cap",
    "served_model_name": "the offline API serves no name (spec-jax serve has --served-model-name)",
}

# Parallelism vLLM offers over several devices that is not built here: only 1 is accepted
# (tensor parallelism is `LLM`'s own `tensor_parallel_size`).
SINGLE_DEVICE = {
    "pipeline_parallel_size": "pipeline parallelism is not built; use tensor_parallel_size",
    "data_parallel_size": "data parallelism is not built: run one LLM per device",
}

# Values of vLLM arguments that are accepted because they ask for what this engine does anyway.
DEFAULTS_ONLY = {"kv_cache_dtype": ("auto",), "enable_lora": (False,), "generation_config": ("auto",),
                 "enable_expert_parallel": (False,), "enable_sleep_mode": (False,),
                 "enable_prompt_embeds": (False,), "calculate_kv_scales": (False,), "model_impl": ("auto",)}

# vLLM arguments that ask for a feature not built here: refused by name unless unset (None, or an
# empty collection), with what is missing.
NOT_BUILT = {
    "structured_outputs_config": "structured output is not built yet",
    "guided_decoding_backend": "structured output is not built yet",
    "reasoning_parser": "reasoning is split by the server (spec-jax serve --reasoning-parser), not by LLM",
    "hf_overrides": "the checkpoint's config.json is read as written",
    "override_generation_config": "sampling defaults come from the checkpoint's generation_config.json",
    "max_loras": "LoRA adapters are not supported", "max_lora_rank": "LoRA adapters are not supported",
    "max_cpu_loras": "LoRA adapters are not supported",
    "kv_transfer_config": "caches are not transferred between engines",
    "kv_events_config": "cache events are not published",
    "logits_processors": "custom logits processors are not supported",
    "task": "only text generation is served", "runner": "only text generation is served",
    "convert": "only text generation is served", "pooler_config": "only text generation is served",
    "override_pooler_config": "only text generation is served",
    "allowed_local_media_path": "the models here read text only",
    "speculative_model": "give the drafter as speculative_config's model",
    "num_speculative_tokens": "give it as speculative_config's num_speculative_tokens",
}

# vLLM's `quantization` values: "fp8" quantizes an unquantized checkpoint's projections to FP8 as it
# loads (vLLM's dynamic FP8); the methods of pre-quantized checkpoints must name what the checkpoint
# holds (its config.json's quantization_config.quant_method).
QUANTIZE_ON_LOAD = {"fp8": "fp8"}
CHECKPOINT_METHODS = ("fp8", "modelopt", "modelopt_fp4", "compressed-tensors", "gguf")

_said: set[str] = set()


def say_ignored(name: str, value) -> None:
    """Warn once per process that vLLM argument `name` is accepted and ignored."""
    if name not in _said:
        _said.add(name)
        warnings.warn(f"{name}={value!r} is accepted for vLLM compatibility and ignored: {IGNORED[name]}", stacklevel=3)


@dataclasses.dataclass
class EngineArgs:
    """The vLLM engine arguments that change something here, resolved from `LLM`'s keywords."""

    gpu_memory_utilization: float | None = None
    quantization: str | None = None


def resolve(kwargs: dict) -> EngineArgs:
    """Check vLLM keyword arguments `LLM` has no parameter of its own for: use, ignore or refuse each
    (see the module docstring). Returns what is used."""
    args = EngineArgs()
    for name, value in kwargs.items():
        if name in IGNORED:
            if value not in (None, False, 0):  # it asks for something this engine does not do
                say_ignored(name, value)
        elif name in SINGLE_DEVICE:
            if value not in (None, 1):
                raise ValueError(f"{name}={value!r}: {SINGLE_DEVICE[name]} (use 1)")
        elif name in DEFAULTS_ONLY:
            if value not in (None, *DEFAULTS_ONLY[name]):
                accepted = " or ".join(repr(v) for v in DEFAULTS_ONLY[name])
                raise ValueError(f"{name}={value!r} is not supported; accepted: {accepted}")
        elif name in NOT_BUILT:
            if value is not None and value != {} and value != [] and value != ():
                raise ValueError(f"{name}={value!r} is not supported: {NOT_BUILT[name]}")
        elif name == "gpu_memory_utilization":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"gpu_memory_utilization={value!r} must be a fraction in (0, 1]")
            args.gpu_memory_utilization = float(value)
        elif name == "quantization":
            methods = dict.fromkeys((*QUANTIZE_ON_LOAD, *CHECKPOINT_METHODS))
            if value is not None and value not in methods:
                raise ValueError(f"quantization={value!r} is not supported; accepted: None, "
                                 f"{', '.join(repr(m) for m in methods)}")
            args.quantization = value
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
    return args


# Our quantized formats -> the vLLM `quantization` names a checkpoint holding them answers to.
VLLM_METHODS = {"fp8_block": ("fp8",), "nvfp4": ("modelopt_fp4", "modelopt")}


def checkpoint_methods(model_path: str | Path) -> tuple[str, ...]:
    """The vLLM `quantization` names the checkpoint at `model_path` answers to; () if unquantized."""
    if find_gguf(model_path) is not None:
        return ("gguf",)
    if not (Path(model_path) / "config.json").exists():
        return ()
    scheme = read_quant_scheme(model_path)
    return VLLM_METHODS.get(scheme.format, ()) if scheme else ()


def check_quantization(requested: str | None, held: tuple[str, ...]) -> str | None:
    """The format to quantize to as the model loads (None: load as stored), given vLLM's
    `quantization` and the vLLM method names the checkpoint's own quantization answers to (empty
    for an unquantized checkpoint). ValueError when they disagree."""
    if requested is None or requested in held:
        return None
    if not held and requested in QUANTIZE_ON_LOAD:
        return QUANTIZE_ON_LOAD[requested]
    what = f"holds {held[0]!r} weights" if held else "is not quantized"
    onload = ", ".join(repr(m) for m in QUANTIZE_ON_LOAD)
    raise ValueError(f"quantization={requested!r} does not match the checkpoint, which {what}; pass None to load it "
                     f"as stored" + ("" if held else f", or {onload} to quantize it as it loads"))
