"""The engine: decode state, the plain and speculative steps and their on-device loop (`steps`),
sampling and rejection (`sampling`), the speculative config (`spec_config`)."""
