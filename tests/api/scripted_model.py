"""A tiny checkpoint whose greedy output follows a script, so that a test can watch the server read
real model output (tool calls, reasoning) that no random model would write.

How: the tokenizer holds each piece of the script as one added token. The residual branches of
every layer are scaled down (they still run, caches and speculation included, but cannot move the
argmax), so the last hidden state is, to within that, the current token's embedding. The script's
tokens get orthonormal embeddings and the LM head scores a token's successors from its direction:
the model is a bigram machine over the script. Where a token has two successors the second scores
lower: a request bans the first (logit_bias, a real request field) to take the other branch.

The chat template is written here in the shape of Qwen3.6's (tools listed in the system turn,
calls rendered as <tool_call><function=...><parameter=...> from their argument objects, tool
results as <tool_response> in a user turn, the generation prompt opening <think> unless
enable_thinking is false, older turns' reasoning kept only with preserve_thinking)."""

import dataclasses

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken

from helpers import TINY
from spec_jax.default_model import train_tokenizer
from spec_jax.writing.random_checkpoint import write_checkpoint

EOS, IM_START = "<|im_end|>", "<|im_start|>"
THINK = "<think>\n"  # the generation prompt's last token: where every answer starts

# (token, successor, score): the script. From THINK the model calls a tool; banned that, it answers.
CALL_TURN = ["Need the weather.", "\n</think>\n\n", "<tool_call>", "\n<function=get_weather>", "\n<parameter=city>",
             "\nParis", "\n</parameter>", "\n</function>", "\n</tool_call>"]
ANSWER_TURN = ["It is sunny.", "</think>\n\n", "Sunny in Paris."]
PIECES = [THINK, *CALL_TURN, *ANSWER_TURN]
SCRIPT = ([(THINK, CALL_TURN[0], 10.0)] + [(a, b, 10.0) for a, b in zip(CALL_TURN, CALL_TURN[1:])] +
          [(CALL_TURN[-1], EOS, 10.0), (THINK, ANSWER_TURN[0], 8.0)] +
          [(a, b, 10.0) for a, b in zip(ANSWER_TURN, ANSWER_TURN[1:])] + [(ANSWER_TURN[-1], EOS, 10.0)])
RESIDUAL_SCALE = 0.05

TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call a function as <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>.<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if preserve_thinking or loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content or '' }}
</think>

{% endif %}{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments | items %}<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

BASE_VOCAB = 320  # the BPE's own tokens; the script's pieces come after them


def scripted_tokenizer():
    tok = train_tokenizer(BASE_VOCAB, texts=["What is the weather in Paris? Sunny, 22 C. " * 20], specials=(EOS,))
    tok.add_special_tokens([AddedToken(IM_START, normalized=False)])
    tok.add_tokens([AddedToken(p, normalized=False) for p in PIECES])
    return tok


def write_scripted_checkpoint(directory):
    """The checkpoint (config, weights, tokenizer.json, chat_template.jinja) in `directory`."""
    tok = scripted_tokenizer()
    ids = {p: tok.token_to_id(p) for p in [EOS, *PIECES]}
    assert max(ids.values()) < TINY.vocab_size and len(set(ids.values())) == len(ids)
    cfg = dataclasses.replace(TINY, eos_token_id=(ids[EOS],))
    write_checkpoint(directory, cfg, seed=5)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    t = load_file(str(directory / "model.safetensors"))
    H, prefix = cfg.hidden_size, "model.language_model."
    for name in t:
        if name.startswith(prefix + "layers.") and name.endswith(("o_proj.weight", "out_proj.weight",
                                                                  "down_proj.weight")):
            t[name] = t[name] * RESIDUAL_SCALE
    directions = np.linalg.qr(np.random.default_rng(0).normal(size=(H, len(ids))))[0].T  # orthonormal rows
    embed = t[prefix + "embed_tokens.weight"]
    for direction, token in zip(directions, ids.values()):
        embed[token] = np.sqrt(H) * direction  # rms 1: the final norm passes it through
    t[prefix + "norm.weight"] = np.zeros(H, np.float32)  # (1 + w) = 1
    head = np.zeros_like(t["lm_head.weight"])
    direction_of = dict(zip(ids.values(), directions))
    for token, successor, score in SCRIPT:
        head[ids[successor]] += score * direction_of[ids[token]] / np.sqrt(H)
    t["lm_head.weight"] = head
    save_file(t, str(directory / "model.safetensors"))
    return ids
