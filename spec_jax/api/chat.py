"""Chat templates (the checkpoint's own, rendered as HF transformers renders them) and the
tokenizer that carries one. `LLM.chat` and the server's endpoints share them.

A checkpoint's template is tokenizer_config.json's `chat_template`, or chat_template.jinja beside
it, or a file the caller names; rendered with jinja2 in a sandbox. A checkpoint without one has no
fallback, because a guessed template would prompt the model in a format it never saw.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox


class RequestError(ValueError):
    """A request the caller got wrong, naming the field (`param`) at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def read_chat_template(model_dir: str | Path, override: str | None = None) -> str | None:
    """The chat template: `override` (a file), else the checkpoint's tokenizer_config.json
    `chat_template` (a string, or a list of named ones: "default" or the first), else its
    chat_template.jinja; None if it has none."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise ValueError(f"chat template file {override!r} does not exist")
        return path.read_text()
    config = tokenizer_config(model_dir)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", template[0].get("template") if template else None)
    if template and not isinstance(template, str):
        raise ValueError(f"{Path(model_dir) / 'tokenizer_config.json'}: chat_template is a "
                         f"{type(template).__name__}; it must be Jinja source text (or a list of named ones)")
    if template:
        return template
    jinja_file = Path(model_dir) / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def tokenizer_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def special_token_text(config: dict, name: str) -> str:
    value = config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else value


class ChatTemplate:
    """A compiled chat template: messages -> prompt text, with HF's rendering conventions
    (trim_blocks, lstrip_blocks, loop controls, tojson, raise_exception, strftime_now)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols],
                                                           loader=jinja2.FunctionLoader(lambda name: None))
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = self._raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
            # the variables it reads: a request's tools reach a template that reads `tools`
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.specials = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def of_checkpoint(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The checkpoint's template (see `read_chat_template`) with its bos/eos token text; None if it has none."""
        source = read_chat_template(model_dir, override)
        if source is None:
            return None
        config = tokenizer_config(model_dir)
        return cls(source, special_token_text(config, "bos_token"), special_token_text(config, "eos_token"))

    @staticmethod
    def _raise(message: str):
        raise jinja2.TemplateError(message)

    def render(self, messages: list[dict], extra: dict | None = None, continue_final: bool = False) -> str:
        """The prompt text; extra (chat_template_kwargs) may set any variable but `messages`,
        add_generation_prompt included (True or False). continue_final (vLLM's
        continue_final_message): the prompt ends with the last message's content, open, for the
        model to continue it. A template is self-contained: one that includes or imports another
        is refused, as is anything else it fails on."""
        if "messages" in (extra or {}):
            raise RequestError("chat_template_kwargs may not set messages; send them as messages",
                               "chat_template_kwargs")
        context = {**self.specials, "add_generation_prompt": True, **(extra or {}), "messages": text_messages(messages)}
        if not isinstance(context["add_generation_prompt"], bool):
            raise RequestError(f"add_generation_prompt={context['add_generation_prompt']!r} must be True or False",
                               "add_generation_prompt")
        if continue_final and context["add_generation_prompt"]:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true: the prompt "
                               "either continues the last message or opens a new one", "continue_final_message")
        try:
            text = self.template.render(context)
        except jinja2.TemplateNotFound as e:
            raise RequestError(f"the chat template includes or imports {e.name!r}; a chat template must be "
                               f"self-contained", "chat_template") from None
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template refused these messages: {e}", "messages") from None
        except Exception as e:  # the template is the caller's code: whatever it raises is a refusal
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               "messages") from None
        return open_final_message(text, context["messages"][-1]["content"]) if continue_final else text


def open_final_message(text: str, content: str) -> str:
    """The rendered `text` cut right after the last message's `content` (leading and trailing
    blank space aside), dropping what the template closes the message with."""
    at = text.rfind(content.strip()) if content.strip() else -1
    if at < 0:
        raise RequestError("continue_final_message: the last message's content is not found in the rendered "
                           "prompt (it must be non-empty text the template writes out)", "continue_final_message")
    return text[:at + len(content.strip())]


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTokenizer:
    """The checkpoint's tokenizer with its chat template: what vLLM's `LLM.get_tokenizer()` gives,
    answering the common calls of an HF tokenizer with HF's defaults (`encode` adds special tokens,
    `decode` keeps them): `encode`, call, `decode`, `batch_decode`, `convert_ids_to_tokens`,
    `convert_tokens_to_ids`, `apply_chat_template`, `len`, `vocab_size`, `all_special_ids`, and the
    special tokens tokenizer_config.json names (`eos_token` / `eos_token_id`, `pad_*`, `bos_*`; None
    if unnamed)."""

    def __init__(self, tokenizer, template: ChatTemplate | None, config: dict | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.config = config or {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} for one text, a list of id lists for a list of texts."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        """A token id's vocabulary string (a list of them for a list of ids)."""
        if isinstance(ids, int):
            return self.tokenizer.hf.id_to_token(ids)
        return [self.tokenizer.hf.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A vocabulary string's id, None if it is none (a list of them for a list of strings)."""
        if isinstance(tokens, str):
            return self.tokenizer.hf.token_to_id(tokens)
        return [self.tokenizer.hf.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.hf.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.tokenizer.hf.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.hf.get_vocab_size(with_added_tokens=True)

    def _special(self, name: str) -> str | None:
        return special_token_text(self.config, name) or None

    eos_token = property(lambda self: self._special("eos_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    bos_token = property(lambda self: self._special("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))

    def _special_id(self, name: str) -> int | None:
        token = self._special(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def all_special_ids(self) -> list[int]:
        """HF's: the ids of the special tokens tokenizer_config.json names (bos, eos, unk, sep, pad,
        cls, mask, then its additional / extra special tokens), each once, in that order."""
        named = [special_token_text(self.config, name) for name in SPECIAL_TOKEN_NAMES]
        extra = self.config.get("additional_special_tokens") or self.config.get("extra_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        texts = named + [t.get("content", "") if isinstance(t, dict) else t for t in extra]
        ids = [self.convert_tokens_to_ids(t) for t in texts if t]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            return_dict: bool = False, **kwargs) -> str | list[int] | dict:
        """HF's signature: the rendered prompt, as token ids unless tokenize=False (as
        {"input_ids": ids} with return_dict); other keywords reach the template (enable_thinking,
        tools, ...)."""
        if self.template is None:
            raise ValueError("this checkpoint has no chat template (no chat_template in its tokenizer_config.json, "
                             "no chat_template.jinja)")
        text = self.template.render(conversation, {"add_generation_prompt": add_generation_prompt, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)  # the template writes the special tokens itself
        return {"input_ids": ids} if return_dict else ids


CONVERSATION_FORMS = "a non-empty list of {role, content} dicts, or a list of such lists"


def conversations(messages) -> list[list[dict]]:
    """`LLM.chat`'s messages as a list of conversations: one conversation (a non-empty list of
    message dicts) or a non-empty list of them. ValueError naming `messages` otherwise."""
    def is_conversation(x) -> bool:
        return isinstance(x, list | tuple) and bool(x) and all(isinstance(m, dict) for m in x)

    if is_conversation(messages):
        return [list(messages)]
    if isinstance(messages, list | tuple) and messages and all(map(is_conversation, messages)):
        return [list(c) for c in messages]
    raise ValueError(f"messages must be {CONVERSATION_FORMS}, got {str(messages)[:80]}")


def text_messages(messages: list[dict]) -> list[dict]:
    """Messages with their content as text, as OpenAI reads them: a string stays, null is empty,
    a list of parts joins its text parts by newlines. A message that is not an object, a role
    that is not a string, any other content, or a part that is not text, is a RequestError naming
    the message."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with a role and content, got {str(m)[:80]}",
                               "messages")
        if not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}].role must be a string (system, user, assistant, tool, ...), got "
                               f"{m.get('role')!r}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise RequestError(f"messages[{i}].content: only text parts "
                                   f"({{\"type\": \"text\", \"text\": ...}}) are supported", "messages")
            content = "\n".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got "
                               f"{type(content).__name__}", "messages")
        out.append({**m, "content": content})
    return out
