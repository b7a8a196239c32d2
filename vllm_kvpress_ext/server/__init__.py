"""OpenAI-compatible HTTP server driving the embedded engine (not built yet)."""
