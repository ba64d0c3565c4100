"""The speculative-decoding config: vLLM's `--speculative-config` JSON, checked and resolved.

`parse_speculative_config` takes what a user gives (None, a dict or a JSON string) and returns a
frozen `SpeculativeConfig` whose `method` is canonical, or None for "no speculation". It knows
every method string and every field of vLLM's `SpeculativeConfig`, so a vLLM command line works
unchanged: fields we act on are validated, fields we do not act on are type-checked and, when set
to a non-default value, named in a warning; unknown fields are named in a warning too. Methods
vLLM has but we have not built yet are refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
import warnings
from pathlib import Path
from typing import Any

from proposers import protocol_gaps

VLLM_METHODS = ("ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
                "extract_hidden_states", "mtp", "dflash", "ngram_gpu", "dspark")
MTP_ALIASES = ("deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp",
               "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp",
               "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "bailing_hybrid_v3_mtp", "minimax_m3_mtp",
               "bailing_hybrid_mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp",
               "gemma4_mtp", "inkling_mtp", "glm5_next_mtp")  # all fold into "mtp"
# "ngram_gpu" is vLLM's prompt lookup run on the GPU, which is what "ngram" is here.
METHOD_ALIASES = {**{a: "mtp" for a in MTP_ALIASES}, "[ngram]": "ngram", "ngram_gpu": "ngram"}
IMPLEMENTED_METHODS = ("ngram", "mtp", "draft_model", "eagle3", "dflash", "dspark", "suffix")
# vLLM's methods not built, each with what to use instead.
INSTEAD = {
    "eagle": "EAGLE-1/2 heads (one layer over the target's last hidden state) are not loaded; use 'eagle3' with "
             "an EAGLE-3 head (Speculators layout), or 'mtp' with the target's own MTP head",
    "medusa": "Medusa heads are not loaded; use 'mtp' (the target's own MTP head) or 'eagle3'",
    "mlp_speculator": "MLP speculators are not loaded; use 'mtp' (the target's own MTP head) or 'eagle3'",
    "custom_class": "no proposer class is imported from outside; give a proposer object as 'proposer' (a "
                    "Python dict only) or use one of the built-in methods",
    "extract_hidden_states": "it drafts nothing; hidden states are not exported",
}
NEEDS_MODEL = ("draft_model", "eagle3", "dflash", "dspark")  # methods whose drafter is a separate checkpoint

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block")
# Documented maxima (a step verifies k + 1 tokens; every draft position costs memory and time).
# The engine also keeps both below max_model_len.
MAX_SPECULATIVE_TOKENS = 64
MAX_PROMPT_LOOKUP = 1024
IMPLEMENTED_REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
RATE_FIELDS = ("synthetic_acceptance_rates", "synthetic_acceptance_length")
MTP_N_PREDICT = 1  # Qwen3.5 / 3.6 / Qwen3-Next ship one MTP layer: k defaults to it
# The MTP alias vLLM derives from each target model_type we load.
TARGET_MTP_ALIAS = {"qwen3_5": "qwen3_5_mtp", "qwen3_5_moe": "qwen3_5_mtp", "qwen3_5_text": "qwen3_5_mtp",
                    "qwen3_5_moe_text": "qwen3_5_mtp", "qwen3_next": "qwen3_next_mtp"}
# vLLM fields the engine fills in itself; a user-given value is ignored.
VLLM_ENGINE_FIELDS = ("target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config")
NAME_PATTERNS = (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark"))


@dataclasses.dataclass(frozen=True, repr=False)
class SpeculativeConfig:
    """A checked speculative-decoding config; field names and defaults are vLLM's.

    Acted on: `method` (canonical, aliases folded), `num_speculative_tokens` (k >= 1), `model`,
    `prompt_lookup_min/max` (ngram window; both default to 5, one given copies to the other),
    `draft_sample_method`, `rejection_sample_method`, `synthetic_acceptance_rates` /
    `synthetic_acceptance_length`, our own `draft_vocab_size` and `proposer`, and
    `enable_adaptive_verification`; for method suffix, the `suffix_decoding_*` fields
    (`proposers.suffix`; k defaults to the tree depth, as in vLLM) and our own
    `suffix_decoding_cache_tokens`: the token slots of the device ring that holds the outputs of
    the last `suffix_decoding_max_cached_requests` finished requests (4 bytes each, twice).
    `enable_suffix_decoding` (ArcticInference's name) on a model method (mtp, eagle3, dflash, dspark,
    draft_model) runs suffix decoding beside its drafter, per row per step (`proposers.combined`):
    the suffix draft (up to the tree depth) where it expects at least k tokens accepted.
    Every field after those is accepted for vLLM compatibility and ignored.

    `enable_adaptive_verification` (vLLM's name, but on unless set to false): each step verifies,
    per row, the number of drafts (0 to `num_speculative_tokens`) that maximises the batch's
    expected tokens per second, from the row's running acceptance and the measured step time at
    each verify width (`spec_jax.engine.adaptive`); false verifies every draft every step (fixed
    k, for benchmarks). Output is the same either way.

    `draft_vocab_size` n (method mtp) has the MTP head draft over token ids 0..n-1 only, so each
    draft reads n rows of the lm_head instead of all of them: at Qwen3.6-27B the full head is
    2.5 GB, three times the MTP block itself. BPE tokenizers number tokens in merge order, so the
    low ids are the frequent ones (FR-Spec's frequency-ranked draft vocabulary). Verification is
    unchanged: output stays exact, only drafts of rarer tokens are lost.

    `rejection_sample_method` "synthetic" (vLLM's benchmarking mode) accepts drafts at a dialled
    rate instead of by comparing them with the target: `synthetic_acceptance_rates` lists, per
    draft position i, the probability that drafts 1..i+1 are all accepted (k values in [0, 1],
    non-increasing), or `synthetic_acceptance_length` asks for a mean acceptance length in
    [1, k + 1] (resolved as vLLM does: full acceptance up to it, the fraction at the next
    position). The drafter and the verify pass run at their full cost; the token after the
    accepted drafts is the target's own. Output is then not the target's: measure speed only.

    `proposer` (ours, from Python only) is an object meeting the `Proposer` protocol
    (`proposers/__init__.py`: `k`, `init_state`, `propose`, `update`, hashable) that drafts in
    place of the method's own proposer, with k equal to `num_speculative_tokens`. With method
    "custom_class" (vLLM's method for a proposer from outside) no drafter network is loaded; with
    another method, that method's network is loaded and handed to it.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple | None = None
    synthetic_acceptance_length: float | None = None
    draft_vocab_size: int | None = None  # ours, method mtp: draft over the first n token ids
    proposer: Any = None  # ours: a Proposer object drafting in place of the method's (see the docstring)
    # ---- vLLM fields accepted and ignored
    enforce_eager: bool | None = None
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None
    moe_backend: str | None = None
    attention_backend: str | None = None
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    revision: str | None = None
    code_revision: str | None = None
    index_share_for_mtp_iteration: bool | None = None
    disable_padded_drafter_batch: bool = False
    disable_eagle_block_drop: bool = False
    use_local_argmax_reduction: bool = False
    use_heterogeneous_vocab: bool = False
    parallel_drafting: bool = False
    num_speculative_tokens_per_batch_size: tuple | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_cache_tokens: int = 32768  # ours, method suffix: token slots of the finished-output cache
    draft_load_config: dict | None = None
    enable_adaptive_verification: bool = True  # vLLM's field; on by default here (see the docstring)
    enable_suffix_decoding: bool = False  # ArcticInference's field: suffix decoding beside a model drafter
    dspark_draft_topk: int | None = None
    speculative_token_tree: str | None = None  # older vLLM releases
    disable_by_batch_size: int | None = None  # older vLLM releases

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "proposer":  # an object, not JSON: `_check_proposer`
                continue
            object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name), _field_types()[f.name]))
        object.__setattr__(self, "method", canonical_method(self.method))
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}")
        self._resolve_lookup_window()
        _check_choice("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        _check_choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        self._check_proposer()
        self._resolve_synthetic_rates()
        if self.enable_suffix_decoding and self.method not in NEEDS_MODEL + ("mtp",):
            raise ValueError(f"enable_suffix_decoding combines suffix decoding with a model drafter (mtp, "
                             f"{', '.join(NEEDS_MODEL)}), not with method {self.method!r}")
        if self.method == "suffix" or self.enable_suffix_decoding:
            self._check_suffix()
        n = self.draft_vocab_size
        if n is not None and (self.method != "mtp" or n < 1):
            raise ValueError(f"draft_vocab_size={n}: it applies to method 'mtp' (a positive number of token ids); "
                             f"EAGLE-3 and DSpark drafters carry their own draft vocabulary")

    def __repr__(self) -> str:
        """Only the method, k and the fields that differ from their defaults."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name in ("method", "num_speculative_tokens") or getattr(self, f.name) != f.default]
        return f"SpeculativeConfig({', '.join(shown)})"

    def _check_proposer(self) -> None:
        """A given proposer meets the `Proposer` protocol at this k; method custom_class needs one."""
        proposer, k = self.proposer, self.num_speculative_tokens
        if proposer is None:
            if self.method == "custom_class":
                raise ValueError(f"speculative method 'custom_class' needs 'proposer': {INSTEAD['custom_class']}")
            return
        gaps = protocol_gaps(proposer)
        if gaps:
            raise ValueError(f"speculative_config.proposer {type(proposer).__name__} does not meet the Proposer "
                             f"protocol (proposers/__init__.py): it lacks {', '.join(gaps)}")
        if proposer.k != k:
            raise ValueError(f"speculative_config.proposer drafts k={proposer.k} tokens but num_speculative_tokens "
                             f"is {k}; give the same k")

    def _resolve_synthetic_rates(self) -> None:
        """Check the synthetic acceptance fields against rejection_sample_method and k; a length
        becomes its rates (all 1 up to the length, then its fraction, then 0)."""
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        k = self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
            if rates is not None or length is not None:
                raise ValueError("synthetic_acceptance_rates / synthetic_acceptance_length need "
                                 "rejection_sample_method 'synthetic'")
            return
        if (rates is None) == (length is None):
            raise ValueError("rejection_sample_method 'synthetic' needs exactly one of synthetic_acceptance_rates "
                             "and synthetic_acceptance_length")
        if length is not None:
            if not 1.0 <= length <= k + 1:
                raise ValueError(f"synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = {k + 1}], "
                                 f"got {length}")
            rates = tuple(min(max(length - 1 - i, 0.0), 1.0) for i in range(k))
        if len(rates) != k or not all(isinstance(r, (int, float)) and 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"synthetic_acceptance_rates must be num_speculative_tokens = {k} numbers in [0, 1], "
                             f"got {list(rates)}")
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"synthetic_acceptance_rates must be non-increasing, got {list(rates)}")
        object.__setattr__(self, "synthetic_acceptance_rates", tuple(float(r) for r in rates))

    def _check_suffix(self) -> None:
        """vLLM's ranges for the suffix_decoding_* fields, and ours for the cache's size."""
        for name, ok, rule in (("max_tree_depth", self.suffix_decoding_max_tree_depth >= 1, ">= 1"),
                               ("max_cached_requests", self.suffix_decoding_max_cached_requests >= 0, ">= 0"),
                               ("max_spec_factor", self.suffix_decoding_max_spec_factor >= 0, ">= 0"),
                               ("min_token_prob", 0 <= self.suffix_decoding_min_token_prob <= 1, "in [0, 1]"),
                               ("cache_tokens", self.suffix_decoding_cache_tokens >= 2, ">= 2")):
            if not ok:
                raise ValueError(f"suffix_decoding_{name}={getattr(self, 'suffix_decoding_' + name)} must be {rule}")

    def same_step(self, other: "SpeculativeConfig") -> bool:
        """Whether `other` runs the same speculative step as this config: equal but for the
        synthetic acceptance rates, which reach the step as data, not as part of its program."""
        def step(c):
            return [getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in RATE_FIELDS]
        return step(self) == step(other)

    def synthetic_conditional_rates(self) -> tuple[float, ...]:
        """Per position, the probability that draft i is accepted given drafts before it were."""
        rates = self.synthetic_acceptance_rates
        return tuple(r if i == 0 else (r / rates[i - 1] if rates[i - 1] > 0 else 0.0) for i, r in enumerate(rates))

    def _resolve_lookup_window(self) -> None:
        """Check prompt_lookup_min/max >= 1; for ngram fill them in (5/5, or one copies the other)."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise ValueError(f"{name} must be between 1 and {MAX_PROMPT_LOOKUP}, got {value}")
        if self.method not in ("ngram", "ngram_gpu"):
            return
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)


ACTED_FIELDS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
                "draft_sample_method", "rejection_sample_method", "synthetic_acceptance_rates",
                "synthetic_acceptance_length", "draft_vocab_size", "proposer", "enable_adaptive_verification",
                "enable_suffix_decoding")
SUFFIX_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig) if f.name.startswith("suffix_decoding_"))
IGNORED_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig) if f.name not in ACTED_FIELDS)
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))
ACCEPTED_METHODS = (*VLLM_METHODS, *METHOD_ALIASES)


@functools.cache
def _field_types() -> dict[str, Any]:
    """Field name -> resolved type hint (the module uses postponed annotations)."""
    return typing.get_type_hints(SpeculativeConfig)


class LongInteger:
    """A JSON integer literal too long for Python to convert (over 4300 digits), kept unconverted
    so that the field given it is refused by name."""

    def __repr__(self) -> str:
        return "<an integer beyond 64 bits>"


def _json_integer(text: str) -> int | LongInteger:
    """A JSON integer literal as an int, or as a LongInteger where Python will not convert it."""
    try:
        return int(text)
    except ValueError:
        return LongInteger()


def _beyond_64_bits(value: Any) -> bool:
    """No field takes an integer of 2**64 or more in magnitude (nor could Python print one of over 4300 digits)."""
    return isinstance(value, LongInteger) or (isinstance(value, int) and abs(value) >= 2**64)


def _checked(name: str, value: Any, hint: Any) -> Any:
    """`value` if it has the JSON type `hint` names (bool is not an int; an int is a float); lists
    become tuples so the config stays hashable. Otherwise ValueError naming the field."""
    options = typing.get_args(hint) or (hint,)
    expected = " or ".join("null" if o is type(None) else "list" if o is tuple else o.__name__ for o in options)
    if _beyond_64_bits(value):
        raise ValueError(f"speculative_config.{name} must be {expected}, got an integer beyond 64 bits")
    for option in options:
        if value is None and option is type(None):
            return None
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is tuple and isinstance(value, (list, tuple)):
            return _freeze(value, name)
        if option in (str, bool, dict) and isinstance(value, option):
            return value
    raise ValueError(f"speculative_config.{name} must be {expected}, got {value!r} ({type(value).__name__})")


MAX_NESTING = 8  # no field nests lists deeper; a deeper value is refused, not recursed into


def _freeze(value: Any, name: str, depth: int = 0) -> Any:
    """Lists as tuples, all the way down (the config stays hashable)."""
    if _beyond_64_bits(value):
        raise ValueError(f"speculative_config.{name} holds an integer beyond 64 bits")
    if not isinstance(value, (list, tuple)):
        return value
    if depth >= MAX_NESTING:
        raise ValueError(f"{name} nests lists more than {MAX_NESTING} deep")
    return tuple(_freeze(v, name, depth + 1) for v in value)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def canonical_method(method: str) -> str:
    """Fold an alias ('qwen3_5_mtp', '[ngram]', ...) into its canonical method; refuse unknown names."""
    if not isinstance(method, str):
        raise ValueError(f"method must be a string, got {method!r}")
    method = METHOD_ALIASES.get(method, method)
    if method not in VLLM_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; accepted: {', '.join(ACCEPTED_METHODS)}")
    return method


def _is_dotted_path(model: str) -> bool:
    """True for an import path such as 'pkg.module.MyProposer' (not a URL, not a hub or file path)."""
    if "/" in model or "://" in model:
        return False
    parts = model.split(".")
    return len(parts) >= 2 and all(p.isidentifier() for p in parts)


def infer_method(model: str) -> str:
    """The method vLLM infers when only `model` is given, as far as the name alone tells."""
    if not isinstance(model, str):
        raise ValueError(f"model must be a string, got {model!r}")
    if _is_dotted_path(model):
        return "custom_class"
    if model in ("ngram", "[ngram]"):
        return "ngram"
    lowered = model.lower()
    return next((method for pattern, method in NAME_PATTERNS if pattern in lowered), "draft_model")


def _decode(spec: dict | str) -> dict:
    """A dict, or a JSON string holding an object -> a fresh dict."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec, parse_int=_json_integer)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("speculative_config nests too deeply to be a config") from None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(spec).__name__}: {spec!r}")
    return dict(spec)


def _warn_unknown(raw: dict) -> None:
    """Warn about fields that are neither vLLM's nor ours (a typo, usually)."""
    unknown = [str(key) for key in raw if key not in {*FIELD_NAMES, *VLLM_ENGINE_FIELDS, "tensor_parallel_size"}]
    if unknown:
        warnings.warn(f"speculative_config: unknown fields {', '.join(unknown)} are ignored", stacklevel=3)


def _warn_ignored(raw: dict, method: str) -> None:
    """Warn about known vLLM fields given a value (other than the default) that we do not act on
    (the suffix_decoding_* fields are acted on by method suffix)."""
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    acted = SUFFIX_FIELDS if method == "suffix" or raw.get("enable_suffix_decoding") else ()
    ignored = [key for key in raw if (key in VLLM_ENGINE_FIELDS and raw[key] is not None)
               or (key in IGNORED_FIELDS and key not in acted and raw[key] != defaults[key])]
    if ignored:
        warnings.warn(f"speculative_config: vLLM fields {', '.join(ignored)} are accepted but ignored by spec_jax",
                      stacklevel=3)


def _resolve_method(raw: dict) -> str:
    """The canonical method: the given one, or inferred from `model` as vLLM does."""
    method, model = raw.get("method"), raw.get("model")
    if method is not None:
        return canonical_method(method)
    if model is not None:
        return infer_method(model)
    if raw.get("num_speculative_tokens") is not None:
        raise ValueError("num_speculative_tokens was provided but without speculative model: set 'method' "
                         "(e.g. 'mtp' or 'ngram') or 'model'")
    raise ValueError(f"speculative_config needs 'method' or 'model'; methods: {', '.join(ACCEPTED_METHODS)}")


def check_mtp_head(target_has_mtp: bool) -> None:
    """ValueError unless the target has the MTP head method 'mtp' drafts with."""
    if not target_has_mtp:
        raise ValueError("speculative method 'mtp' needs the target's MTP head, but the checkpoint has no mtp.* "
                         "tensors (a GGUF/safetensors export without the MTP head cannot run mtp); use 'ngram' "
                         "or a checkpoint that keeps mtp.*")


def _check_mtp_target(raw_method: Any, target_has_mtp: bool, target_model_type: str | None) -> None:
    check_mtp_head(target_has_mtp)
    expected = TARGET_MTP_ALIAS.get(target_model_type)
    if expected and raw_method in MTP_ALIASES and raw_method != expected:
        warnings.warn(f"method {raw_method!r} names another model family than the target ({target_model_type}, "
                      f"whose alias is {expected!r}); running the target's own MTP head", stacklevel=3)


def parse_speculative_config(spec: dict | str | None, *, target_model: str | None = None, target_has_mtp: bool = True,
                             target_model_type: str | None = None) -> SpeculativeConfig | None:
    """vLLM-style `--speculative-config` (None, '', a dict or a JSON string) -> SpeculativeConfig, or None.

    target_model: the target's path; method 'mtp' without `model` uses it (the MTP head lives in
      the target checkpoint).
    target_has_mtp: whether the target checkpoint has mtp.* tensors; 'mtp' is refused without them.
    target_model_type: the target's HF model_type; an MTP alias of another family draws a warning.
    Raises ValueError naming the field and value for anything malformed, unknown or not implemented.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    if not isinstance(spec, (dict, str)):
        raise ValueError(f"speculative_config must be a dict or a JSON string, got {type(spec).__name__}")
    raw = _decode(spec)
    if raw.get("tensor_parallel_size") is not None:
        raise ValueError("'tensor_parallel_size' is not a field of speculative_config; "
                         "use 'draft_tensor_parallel_size' for the draft model")
    _warn_unknown(raw)
    if isinstance(raw.get("model"), str) and "\0" in raw["model"]:  # before any path is resolved
        raise ValueError(f"speculative_config.model must be a path or a Hugging Face repo id; {raw['model']!r} has "
                         f"a NUL byte")
    method = _resolve_method(raw)
    if method not in IMPLEMENTED_METHODS and not (method == "custom_class" and raw.get("proposer") is not None):
        raise ValueError(f"speculative method {method!r} is not implemented: {INSTEAD[method]}; "
                         f"implemented: {', '.join(IMPLEMENTED_METHODS)}")
    fields = {key: value for key, value in raw.items() if key in FIELD_NAMES}
    fields["method"] = method
    if method == "mtp":
        given = fields.get("model")
        if given and target_model and Path(str(given)).resolve() != Path(str(target_model)).resolve():
            warnings.warn(f"speculative_config: method 'mtp' drafts with the target's own MTP head; "
                          f"model={given!r} is ignored", stacklevel=2)
        fields["model"] = given or target_model
        if fields.get("num_speculative_tokens") is None:
            fields["num_speculative_tokens"] = MTP_N_PREDICT
    if method == "suffix" and fields.get("num_speculative_tokens") is None:  # vLLM: the tree's depth, a maximum
        fields["num_speculative_tokens"] = fields.get("suffix_decoding_max_tree_depth", 24)
    if fields.get("num_speculative_tokens") is None:
        raise ValueError(f"num_speculative_tokens is required for speculative method {method!r}")
    if method in NEEDS_MODEL and not fields.get("model"):
        raise ValueError(f"speculative method {method!r} needs 'model': the draft checkpoint's directory")
    config = SpeculativeConfig(**fields)
    if config.rejection_sample_method not in IMPLEMENTED_REJECTION_SAMPLE_METHODS:
        raise ValueError(f"rejection_sample_method {config.rejection_sample_method!r} is not implemented yet; "
                         f"implemented: {', '.join(IMPLEMENTED_REJECTION_SAMPLE_METHODS)}")
    if method == "mtp":
        _check_mtp_target(raw.get("method"), target_has_mtp, target_model_type)
    _warn_ignored(raw, method)
    return config
