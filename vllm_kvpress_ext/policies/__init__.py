"""Compression policies, one per file, and their registry (not built yet)."""
