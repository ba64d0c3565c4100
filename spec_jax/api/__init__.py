"""What users call: `LLM` (`llm`), the `spec-jax` command (`cli`), the OpenAI-compatible server
(`server`, `scheduler`) and batch evaluation (`batch_eval`)."""
