"""The request and result types of the offline API, with vLLM's names, fields and defaults:
`SamplingParams`, `RequestOutput`, `CompletionOutput`, `Logprob`; n-way fan-out and the
checkpoint's generation defaults."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import re
from pathlib import Path

import numpy as np

from spec_jax.engine.structured import StructuredOutputsParams, as_structured

log = logging.getLogger("spec_jax")

# vLLM SamplingParams fields not built yet: anything but their neutral value is refused by name rather
# than silently ignored.
NOT_YET = {"logits_processors": None, "truncate_prompt_tokens": None}
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
# vLLM SamplingParams keywords with no field here: refused by name (ValueError saying why), never a
# bare TypeError; a keyword vLLM does not have either is a TypeError naming it.
NOT_FIELDS = {
    "output_kind": "LLM.generate returns whole outputs; stream with LLM.generate_stream or the server",
    "skip_reading_prefix_cache": "a prefix-cache hit gives bitwise the same output, so there is nothing to skip",
    "flat_logprobs": "logprobs are returned as vLLM's lists of per-token dicts",
}


def check_keywords(cls, kwargs: dict) -> None:
    """A keyword that is no field of `cls`: ValueError when vLLM has it (`NOT_FIELDS` says why it
    is not here), else a TypeError naming it and the field it most resembles."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for name in kwargs.keys() - fields:
        if name in NOT_FIELDS:
            raise ValueError(f"SamplingParams({name}=...) is vLLM's but not supported here: {NOT_FIELDS[name]}")
        close = difflib.get_close_matches(name, sorted(fields), n=1)
        raise TypeError(f"SamplingParams got an unexpected keyword argument {name!r}"
                        + (f"; did you mean {close[0]!r}?" if close else ""))


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request; the fields and defaults are vLLM's.

    temperature 0 is greedy. top_k <= 0 and top_p = 1 switch those filters off. max_tokens
    None generates until a stop token or max_model_len. n completions per prompt run as rows of
    one batch (each its own random stream; greedy ones are alike). stop: strings that end a
    completion, found in the detokenized text (the text ends before one, or after it with
    include_stop_str_in_output). logit_bias ({token id: bias}), allowed_token_ids, bad_words
    (token sequences banned once the generated text ends with all but their last token) and
    min_tokens (stop ids masked until that many tokens) and the presence / frequency / repetition
    penalties change what greedy picks too; min_p filters after temperature. logprobs and
    prompt_logprobs report the target's raw log-probabilities (the top n and the token's own).
    All hold with speculation on: drafts are verified against the processed distribution.
    structured_outputs (vLLM's `StructuredOutputsParams`, or a dict of its fields) constrains the
    output to a JSON schema, regex, choice or grammar, with speculation on too; guided_decoding is
    vLLM's older name for it. The fields in `NOT_YET` are accepted at their neutral values.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    speculative: bool = True  # spec_jax extension: False opts this request out of drafting

    def __new__(cls, *args, **kwargs):
        """Keywords are checked before the dataclass's own __init__ sees them (`check_keywords`)."""
        check_keywords(cls, kwargs)
        return super().__new__(cls)

    def __post_init__(self):
        """Refuse, naming the field, what is not of the field's type or range (nothing is
        coerced: 2.5 tokens or a string temperature are errors, not 2 tokens or a crash later)."""
        check_int("n", self.n, 1, 4096, "must be a positive number of completions")
        self.structured_outputs = as_structured(self.structured_outputs, "structured_outputs")
        self.guided_decoding = as_structured(self.guided_decoding, "guided_decoding")
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("structured_outputs and guided_decoding are two names of one field; set one")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (vLLM's V1 engine dropped it too): "
                             f"ask for n={self.best_of} completions and rank them yourself")
        for name, neutral in NOT_YET.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported yet; only {neutral!r} is "
                                 f"accepted (the supported fields: n, temperature, top_p, top_k, min_p, seed, stop, "
                                 f"stop_token_ids, bad_words, ignore_eos, max_tokens, min_tokens, logit_bias, "
                                 f"allowed_token_ids, presence_penalty, frequency_penalty, repetition_penalty, "
                                 f"logprobs, prompt_logprobs, include_stop_str_in_output, skip_special_tokens, "
                                 f"detokenize, structured_outputs)")
        check_real("temperature", self.temperature, "must be >= 0 (0 means greedy)", lambda t: t >= 0)
        check_real("top_p", self.top_p, "must be in (0, 1]", lambda p: 0 < p <= 1)
        check_real("min_p", self.min_p, "must be in [0, 1]", lambda p: 0 <= p <= 1)
        check_real("presence_penalty", self.presence_penalty, "must be in [-2, 2]", lambda p: -2 <= p <= 2)
        check_real("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]", lambda p: -2 <= p <= 2)
        check_real("repetition_penalty", self.repetition_penalty, "must be > 0 (1 is off)", lambda p: p > 0)
        check_int("min_tokens", self.min_tokens, 0, INT32_MAX, "must be >= 0")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"must be 0 (the sampled token's only) to "
                                                                  f"{MAX_LOGPROBS}")
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, f"must be 0 (each prompt token's "
                                                                                f"only) to {MAX_LOGPROBS}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not re.fullmatch(r"-?[0-9]+", str(token)):  # ASCII digits: str.isdigit takes "²"
                    raise ValueError(f"logit_bias key {token!r} must be a token id")
                check_real(f"logit_bias[{token}]", bias, "must be a finite number", lambda b: True)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
            for i, t in enumerate(self.allowed_token_ids):
                check_int(f"allowed_token_ids[{i}]", t, 0, INT32_MAX, "must be a token id")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        check_int("top_k", self.top_k, -1, INT32_MAX, "must be -1 or 0 (off) or a positive count")
        if self.seed is not None:
            check_int("seed", self.seed, -(2**63), 2**63 - 1, "must fit in 64 bits")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, INT32_MAX, "must be a positive number of tokens (or None)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            for i, t in enumerate(self.stop_token_ids):
                check_int(f"stop_token_ids[{i}]", t, 0, INT32_MAX, "must be a token id")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x
                                                                                  for x in stops)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        for name in ("ignore_eos", "skip_special_tokens", "speculative", "detokenize", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def structured(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, under either of its names."""
        return self.structured_outputs or self.guided_decoding

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


INT32_MAX = 2**31 - 1  # token ids, counts and top_k live in int32 on the device


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """vLLM's parallel sampling: n completions as n requests of one, the i-th seeded seed + i (so a
    seeded request's samples differ from each other and repeat run to run)."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, best_of=None,
                                seed=None if params.seed is None else wrap_int64(params.seed + i))
            for i in range(params.n)]


def wrap_int64(x: int) -> int:
    """x wrapped into the signed 64-bit range a seed takes (a seed near its top still fans out)."""
    return (x + 2**63) % 2**64 - 2**63


# generation_config.json keys vLLM reads as a request's sampling defaults.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "max_new_tokens")


def generation_defaults(model_path: str | None) -> dict:
    """The checkpoint's generation_config.json sampling defaults as SamplingParams fields (vLLM's
    `generation_config="auto"`); the neutral ones only where they are not yet supported."""
    path = Path(model_path) / "generation_config.json" if model_path else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    out = {}
    for key in GENERATION_DEFAULTS:
        if config.get(key) is None:
            continue
        name = "max_tokens" if key == "max_new_tokens" else key
        if name in NOT_YET and config[key] != NOT_YET[name]:
            log.warning("%s sets %s=%r, which spec_jax does not support yet; requests use %r", path.name, key,
                        config[key], NOT_YET[name])
            continue
        out[name] = config[key]
    return out


def check_int(name: str, value, lo: int, hi: int, rule: str) -> None:
    """ValueError naming `name` unless value is an int (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={shown(value)} {rule}")


def shown(value: int) -> str:
    """An integer as an error message shows it: its digits, or its size where Python will not print
    it (over 4300 digits)."""
    try:
        return str(value)
    except ValueError:
        return f"an integer of {int(value).bit_length()} bits"


FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def as_float32(value) -> float | None:
    """A real number as the device holds it: rounded to float32, subnormals flushed to zero (as
    GPUs do); None where it is not finite there."""
    try:
        x = float(value)
    except OverflowError:  # an int beyond float64
        return None
    if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
        return None
    x = float(np.float32(x))
    return 0.0 if abs(x) < FLOAT32_TINY else x


def check_real(name: str, value, rule: str, ok) -> None:
    """ValueError naming `name` unless value is a real number (not a bool) that is finite as a
    float32 (`as_float32`: the dtype every sampling field is used in) and for which ok(that float32)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    x = as_float32(value)
    if x is None:
        raise ValueError(f"{name}={shown(value)} {rule}, as a finite float32 (the dtype it is used in: "
                         f"|x| <= {FLOAT32_MAX:.3g})")
    if not ok(x):
        held = f"; as float32, the dtype it is used in, it is {x}" if x != value else ""
        raise ValueError(f"{name}={shown(value)} {rule}{held}")


@dataclasses.dataclass
class Logprob:
    """vLLM's: a token's log-probability under the target's raw logits, its rank (1 = the most
    likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entries(token_ids, token_logprob, rank, top_ids, top, num: int, decode=None) -> list[dict[int, Logprob]]:
    """vLLM's per-token logprobs: for each of token_ids [n], the `num` most likely entries
    (top_ids, top [n, >= num], ranked 1, 2, ...) and the token's own (token_logprob [n], rank [n])
    when it is not among them. decode(id) -> str fills decoded_token when given."""
    entries = []
    for j, token in enumerate(token_ids):
        entry = {int(t): Logprob(float(v), r + 1) for r, (t, v) in enumerate(zip(top_ids[j, :num], top[j, :num]))}
        entry.setdefault(int(token), Logprob(float(token_logprob[j]), int(rank[j])))
        if decode is not None:
            for t, logprob in entry.items():
                logprob.decoded_token = decode(t)
        entries.append(entry)
    return entries


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or string) or "length" (max_tokens or max_model_len)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None at EOS or length
    cumulative_logprob: float | None = None  # the sum of token_ids' logprobs, when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None = None  # per token: its own and the top-`logprobs` entries

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict
    finished: bool = True
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (vLLM's)
