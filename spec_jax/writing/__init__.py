"""Checkpoints out: `spec-jax convert`'s Orbax directories (`convert`), weight-only quantized
checkpoints (`quantize_checkpoint`), GGUF files (`gguf_writer`) and the random checkpoints tests
and benchmarks build (`random_checkpoint`)."""
