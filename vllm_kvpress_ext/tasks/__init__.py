"""The task suite the benches, training and demos score KV-cache compression on.

- `synthetic/`: RULER-like tasks over the word-level `tokenizer`, for the bundled model trained on them;
- `natural/`: natural-language tasks rendered for a real tokenizer at any length (SmolLM2 and the like).

Benches (`vllm_kvpress_ext.bench`), training (`vllm_kvpress_ext.train`) and `kvpress profile` import the
suite from here; it imports none of them.
"""
