"""Benchmarks that print tables: cache bookkeeping and compaction (`kvpress bench cache`)."""
