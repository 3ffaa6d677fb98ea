"""Training: tokenizer, corpus and packing (data), trainer, checkpoints (SPEC §7)."""
