"""A vLLM offline script as users write them, kept unchanged but for its import line: the test
that runs it (test_vllm_compat.py) also checks that no other line names spec_jax."""

from spec_jax import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams


def main(model: str) -> dict:
    llm = LLM(model=model, tokenizer=model, dtype="float32", max_model_len=128, max_num_seqs=4, seed=0,
              gpu_memory_utilization=0.9, enforce_eager=True, trust_remote_code=True, tensor_parallel_size=1)
    tokenizer = llm.get_tokenizer()

    prompts = ["def add(a, b):", "The module provides"]
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=12, seed=7, stop=["\n\n"])
    outputs = llm.generate(prompts, params)
    completions = []
    for output in outputs:
        for completion in output.outputs:
            completions.append((output.prompt, completion.index, completion.text, list(completion.token_ids),
                                completion.finish_reason, completion.stop_reason))

    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hi"}]
    chat = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    by_ids = llm.generate({"prompt_token_ids": tokenizer.encode("Hello")}, SamplingParams(temperature=0, max_tokens=4))
    defaults = llm.get_default_sampling_params()
    counters = {metric.name: getattr(metric, "value", None) for metric in llm.get_metrics()}
    return {"completions": completions, "chat": chat[0].outputs[0].text, "chat_prompt": chat[0].prompt,
            "rendered": rendered, "by_ids": by_ids[0].outputs[0].token_ids, "defaults": defaults, "counters": counters}
