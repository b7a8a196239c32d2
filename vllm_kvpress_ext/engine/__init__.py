"""Embedded continuous-batching engine over the paged per-head cache (not built yet)."""
