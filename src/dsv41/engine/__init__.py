"""Inference engine: packed caches, encoder-only prefill with bounded replay, batched decode."""
