"""vLLM's engine arguments as spec_jax reads them, so that a vLLM script runs with only its import
changed. `LLM(**kwargs)` and the CLI take vLLM's names; each argument is

* used: it means here what it means in vLLM (`LLM`'s own parameters, and those below that
  `EngineArgs.resolve` turns into values for it: `gpu_memory_utilization`, `quantization`,
  `reasoning_parser`, `mamba_ssm_cache_dtype`);
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

# Every field of vLLM's EngineArgs (vllm/engine/arg_utils.py, vLLM 0.11), which `LLM(**kwargs)` takes:
# each is one of `LLM`'s own parameters, `USED` below, or in one of the tables after it (the test
# test_every_vllm_engine_argument_is_classified holds this).
VLLM_ENGINE_ARGS = """
model served_model_name tokenizer hf_config_path runner convert task skip_tokenizer_init enable_prompt_embeds
tokenizer_mode trust_remote_code allowed_local_media_path allowed_media_domains download_dir safetensors_load_strategy
load_format config_format dtype kv_cache_dtype seed max_model_len cuda_graph_sizes cudagraph_capture_sizes
max_cudagraph_capture_size distributed_executor_backend pipeline_parallel_size tensor_parallel_size
decode_context_parallel_size data_parallel_size data_parallel_rank data_parallel_start_rank data_parallel_size_local
data_parallel_address data_parallel_rpc_port data_parallel_hybrid_lb data_parallel_backend enable_expert_parallel
all2all_backend enable_dbo dbo_decode_token_threshold dbo_prefill_token_threshold disable_nccl_for_dp_synchronization
eplb_config enable_eplb expert_placement_strategy _api_process_count _api_process_rank num_redundant_experts
eplb_window_size eplb_step_interval eplb_log_balancedness max_parallel_loading_workers block_size enable_prefix_caching
prefix_caching_hash_algo disable_sliding_window disable_cascade_attn swap_space cpu_offload_gb gpu_memory_utilization
kv_cache_memory_bytes max_num_batched_tokens max_num_partial_prefills max_long_partial_prefills
long_prefill_token_threshold max_num_seqs max_logprobs logprobs_mode disable_log_stats aggregate_engine_logging revision
code_revision rope_scaling rope_theta hf_token hf_overrides tokenizer_revision quantization enforce_eager
disable_custom_all_reduce limit_mm_per_prompt enable_mm_embeds interleave_mm_strings media_io_kwargs
mm_processor_kwargs
disable_mm_preprocessor_cache mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb
mm_encoder_tp_mode mm_encoder_attn_backend io_processor_plugin skip_mm_profiling video_pruning_rate enable_lora
max_loras
max_lora_rank default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_extra_vocab_size ray_workers_use_nsight
num_gpu_blocks_override num_lookahead_slots model_loader_extra_config ignore_patterns enable_chunked_prefill
disable_chunked_mm_input disable_hybrid_kv_cache_manager structured_outputs_config reasoning_parser
guided_decoding_backend guided_decoding_disable_fallback guided_decoding_disable_any_whitespace
guided_decoding_disable_additional_properties logits_processor_pattern speculative_config
show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces scheduling_policy scheduler_cls
external_parameters pooler_config override_pooler_config compilation_config worker_cls worker_extension_cls
kv_transfer_config kv_events_config generation_config enable_sleep_mode override_generation_config model_impl
override_attention_dtype calculate_kv_scales mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size additional_config
use_tqdm_on_load pt_load_map_location enable_multimodal_encoder_data_parallel logits_processors async_scheduling
kv_sharing_fast_prefill
""".split()
# Those that are flags without a value on vLLM's command line (`--enforce-eager`, `--no-enforce-eager`).
VLLM_BOOL_ARGS = frozenset("""
skip_tokenizer_init enable_prompt_embeds trust_remote_code data_parallel_hybrid_lb enable_expert_parallel enable_dbo
disable_nccl_for_dp_synchronization enable_eplb eplb_log_balancedness enable_prefix_caching disable_sliding_window
disable_cascade_attn disable_log_stats aggregate_engine_logging enforce_eager disable_custom_all_reduce enable_mm_embeds
interleave_mm_strings disable_mm_preprocessor_cache skip_mm_profiling enable_lora fully_sharded_loras
ray_workers_use_nsight enable_chunked_prefill disable_chunked_mm_input disable_hybrid_kv_cache_manager
guided_decoding_disable_fallback guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties
enable_sleep_mode calculate_kv_scales use_tqdm_on_load enable_multimodal_encoder_data_parallel async_scheduling
kv_sharing_fast_prefill
""".split())

# Resolved here into values `LLM` acts on.
USED = ("gpu_memory_utilization", "quantization", "reasoning_parser", "mamba_ssm_cache_dtype")

TEXT_ONLY = "the models here read text only"
NO_CUDA_GRAPHS = "there are no CUDA graphs; batch_buckets sets the batch sizes compiled for"
WHOLE_PREFILL = "prompts are prefilled whole (the GDN kernel chunks them internally)"
LOCAL_FILES = "checkpoints are read from local files"
NO_EXPERT_PARALLEL = "expert parallelism is not built: tensor_parallel_size splits every expert by channel"
NO_DATA_PARALLEL = "data parallelism is not built: run one LLM per device"
NO_STRUCTURED = ("structured output is set per request (SamplingParams.structured_outputs, the server's "
                 "response_format / structured_outputs / guided_*), with llguidance; no engine-wide options")
NO_LORA = "LoRA adapters are not supported"
AS_WRITTEN = "the checkpoint's config.json is read as written"
TEXT_GENERATION = "only text generation is served"

# vLLM arguments with no counterpart here, and why: accepted, and said once.
IGNORED = {
    "enforce_eager": "spec_jax always runs ahead-of-time compiled XLA programs; there are no CUDA graphs to skip",
    "trust_remote_code": "the Qwen3.5/3.6 architectures are built in; no code from the checkpoint is run",
    "skip_tokenizer_init": "the checkpoint's tokenizer loads when it has one; token-id prompts work either way",
    "swap_space": "each row's caches live on the device for its whole request; nothing is swapped",
    "cpu_offload_gb": "weights are not offloaded to the host",
    "disable_custom_all_reduce": "XLA's collectives do the all-reduce; there is no custom one to turn off",
    "disable_log_stats": "the engine keeps no periodic stats log",
    "aggregate_engine_logging": "the engine keeps no periodic stats log",
    "show_hidden_metrics_for_version": "every metric is shown",
    "enable_chunked_prefill": WHOLE_PREFILL, "max_num_batched_tokens": WHOLE_PREFILL,
    "max_num_partial_prefills": WHOLE_PREFILL, "max_long_partial_prefills": WHOLE_PREFILL,
    "long_prefill_token_threshold": WHOLE_PREFILL,
    "block_size": "caches are contiguous per row, not paged",
    "num_gpu_blocks_override": "caches are contiguous per row, not paged",
    "mamba_block_size": "GDN state is kept per row, not paged",
    "prefix_caching_hash_algo": "prefix blocks are keyed by SHA-256 over the whole prefix",
    "disable_hybrid_kv_cache_manager": "attention keeps KV caches and GDN its state, each in its own arrays",
    "kv_sharing_fast_prefill": "no layers share KV caches in these models",
    "disable_sliding_window": "these models have no sliding-window attention",
    "disable_cascade_attn": "there is no cascade attention",
    "num_lookahead_slots": "the step sizes its own verify window",
    "async_scheduling": "the decode loop runs on the device; the host does not schedule between steps",
    "tokenizer_mode": "one tokenizer implementation (HF tokenizers' tokenizer.json)",
    "revision": LOCAL_FILES, "tokenizer_revision": LOCAL_FILES, "code_revision": LOCAL_FILES,
    "download_dir": LOCAL_FILES, "hf_token": LOCAL_FILES,
    "load_format": "the format is detected from the files",
    "safetensors_load_strategy": "safetensors are read tensor by tensor from memory maps",
    "model_loader_extra_config": "the loader takes no options", "ignore_patterns": "the loader takes no options",
    "use_tqdm_on_load": "a progress bar shows for checkpoints over 256 MiB",
    "pt_load_map_location": "no PyTorch files are read",
    "max_parallel_loading_workers": "one process reads the checkpoint",
    "compilation_config": "XLA compiles every program; there is no separate compilation level",
    "cuda_graph_sizes": NO_CUDA_GRAPHS, "cudagraph_capture_sizes": NO_CUDA_GRAPHS,
    "max_cudagraph_capture_size": NO_CUDA_GRAPHS, "max_seq_len_to_capture": NO_CUDA_GRAPHS,
    "distributed_executor_backend": "one process drives every device of the mesh (jax.distributed across hosts)",
    "ray_workers_use_nsight": "there are no Ray workers",
    "_api_process_count": "set by vLLM's API server processes",
    "_api_process_rank": "set by vLLM's API server processes",
    "external_parameters": "they tune vLLM's own scheduler",
    "disable_log_requests": "requests are not logged",
    "all2all_backend": NO_EXPERT_PARALLEL, "expert_placement_strategy": NO_EXPERT_PARALLEL,
    "num_redundant_experts": NO_EXPERT_PARALLEL, "eplb_window_size": NO_EXPERT_PARALLEL,
    "eplb_step_interval": NO_EXPERT_PARALLEL, "eplb_log_balancedness": NO_EXPERT_PARALLEL,
    "dbo_decode_token_threshold": "dual-batch overlap is not built", "dbo_prefill_token_threshold":
        "dual-batch overlap is not built",
    "disable_nccl_for_dp_synchronization": NO_DATA_PARALLEL,
    **dict.fromkeys(("limit_mm_per_prompt", "mm_processor_kwargs", "enable_mm_embeds", "interleave_mm_strings",
                     "media_io_kwargs", "disable_mm_preprocessor_cache", "mm_processor_cache_gb",
                     "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode",
                     "mm_encoder_attn_backend", "skip_mm_profiling", "video_pruning_rate", "disable_chunked_mm_input",
                     "enable_multimodal_encoder_data_parallel"), TEXT_ONLY),
    **dict.fromkeys(("default_mm_loras", "fully_sharded_loras", "lora_dtype", "lora_extra_vocab_size"), NO_LORA),
    "max_logprobs": "a request may ask for up to 20 logprobs (vLLM's default), a fixed cap",
    "served_model_name": "the offline API serves no name (spec-jax serve has --served-model-name)",
}

# Parallelism vLLM offers over several devices that is not built here: only 1 is accepted
# (tensor parallelism is `LLM`'s own `tensor_parallel_size`).
SINGLE_DEVICE = {
    "pipeline_parallel_size": "pipeline parallelism is not built; use tensor_parallel_size",
    "decode_context_parallel_size": "context parallelism is not built; use tensor_parallel_size",
    "data_parallel_size": NO_DATA_PARALLEL,
}

# Values of vLLM arguments that are accepted because they ask for what this engine does anyway.
DEFAULTS_ONLY = {"kv_cache_dtype": ("auto",), "enable_lora": (False,), "generation_config": ("auto",),
                 "enable_expert_parallel": (False,), "enable_sleep_mode": (False,),
                 "enable_prompt_embeds": (False,), "calculate_kv_scales": (False,), "model_impl": ("auto",),
                 "config_format": ("auto", "hf"), "logprobs_mode": ("raw_logprobs",), "scheduling_policy": ("fcfs",),
                 "worker_cls": ("auto",), "mamba_cache_dtype": ("auto",),
                 "enable_dbo": (False,), "enable_eplb": (False,), "data_parallel_hybrid_lb": (False,)}

# vLLM arguments that ask for a feature not built here: refused by name unless unset (None, or an
# empty collection), with what is missing.
NOT_BUILT = {
    "structured_outputs_config": NO_STRUCTURED, "guided_decoding_backend": NO_STRUCTURED,
    "guided_decoding_disable_fallback": NO_STRUCTURED, "guided_decoding_disable_any_whitespace": NO_STRUCTURED,
    "guided_decoding_disable_additional_properties": NO_STRUCTURED,
    "hf_overrides": AS_WRITTEN, "hf_config_path": AS_WRITTEN, "rope_scaling": AS_WRITTEN, "rope_theta": AS_WRITTEN,
    "override_attention_dtype": "attention runs in the model's dtype",
    "override_generation_config": "sampling defaults come from the checkpoint's generation_config.json",
    "max_loras": NO_LORA, "max_lora_rank": NO_LORA, "max_cpu_loras": NO_LORA,
    "kv_transfer_config": "caches are not transferred between engines",
    "kv_events_config": "cache events are not published",
    "kv_cache_memory_bytes": "size the caches with gpu_memory_utilization or max_num_seqs",
    "logits_processors": "custom logits processors are not supported",
    "logits_processor_pattern": "custom logits processors are not supported",
    "task": TEXT_GENERATION, "runner": TEXT_GENERATION, "convert": TEXT_GENERATION, "pooler_config": TEXT_GENERATION,
    "override_pooler_config": TEXT_GENERATION, "io_processor_plugin": TEXT_GENERATION,
    "allowed_local_media_path": TEXT_ONLY, "allowed_media_domains": TEXT_ONLY,
    "otlp_traces_endpoint": "traces are not exported", "collect_detailed_traces": "traces are not exported",
    "scheduler_cls": "no classes are loaded from outside", "worker_extension_cls": "no classes are loaded from outside",
    "additional_config": "no platform plugins are loaded",
    "eplb_config": NO_EXPERT_PARALLEL,
    **dict.fromkeys(("data_parallel_rank", "data_parallel_start_rank", "data_parallel_size_local",
                     "data_parallel_address", "data_parallel_rpc_port", "data_parallel_backend"), NO_DATA_PARALLEL),
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
class ResolvedArgs:
    """The vLLM engine arguments that change something here, resolved from `LLM`'s keywords."""

    gpu_memory_utilization: float | None = None
    quantization: str | None = None
    reasoning_parser: str | None = None
    mamba_ssm_cache_dtype: str = "auto"


def unset(value) -> bool:
    """Whether a vLLM argument's value asks for nothing: None, False or an empty collection (what
    `EngineArgs` passes for an argument not given)."""
    return value is None or value is False or (isinstance(value, (dict, list, tuple, str)) and not value)


def resolve(kwargs: dict) -> ResolvedArgs:
    """Check vLLM keyword arguments `LLM` has no parameter of its own for: use, ignore or refuse each
    (see the module docstring). Returns what is used."""
    args = ResolvedArgs()
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
            if not unset(value):
                raise ValueError(f"{name}={value!r} is not supported: {NOT_BUILT[name]}")
        elif name == "gpu_memory_utilization":
            if value is None:  # not given
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"gpu_memory_utilization={value!r} must be a fraction in (0, 1]")
            args.gpu_memory_utilization = float(value)
        elif name == "quantization":
            methods = dict.fromkeys((*QUANTIZE_ON_LOAD, *CHECKPOINT_METHODS))
            if value is not None and value not in methods:
                raise ValueError(f"quantization={value!r} is not supported; accepted: None, "
                                 f"{', '.join(repr(m) for m in methods)}")
            args.quantization = value
        elif name == "reasoning_parser":
            args.reasoning_parser = value or None  # checked by EngineConfig
        elif name == "mamba_ssm_cache_dtype":
            args.mamba_ssm_cache_dtype = "auto" if value is None else value  # checked by EngineConfig
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
