"""The engine, below the front ends: its options (`config`), the decode state and plan (`state`), the
step functions and on-device loop (`step`), prefix caching (`prefix_cache`, `prefix_programs`), the
compiled programs (`runner`), and the `EngineCore` LLM and the server drive (`core`); with sampling
and rejection (`sampling`), the speculative config (`spec_config`), requests and results (`params`,
`batch`, `metrics`, `detokenize`)."""
