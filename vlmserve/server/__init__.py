"""The OpenAI-compatible HTTP server: app factory, engine thread, media fetch, metrics."""
