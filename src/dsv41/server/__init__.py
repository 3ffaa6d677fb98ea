"""OpenAI-compatible serving: protocol (schemas), app (routes), scheduler (continuous batching), metrics, cli."""
