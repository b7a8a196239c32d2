"""Small helpers shared across the package (environment report, formatting)."""
