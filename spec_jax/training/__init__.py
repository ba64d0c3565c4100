"""Training the embedded default model: corpus, tokenizer, target + MTP, DFlash drafter, draft
model, and their export in the released layouts. `python -m spec_jax.training.train --help`."""
