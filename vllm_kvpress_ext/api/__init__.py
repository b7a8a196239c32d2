"""What both OpenAI-compatible servers share, so `kvpress serve` and `vllm serve` with the plugin agree.

- `errors`: the OpenAI-shaped error every failure becomes;
- `policy_spec`: the operator's `--kv-policy` and each client's `kv_policy` / `vllm_xargs`, parsed and
  validated once, and the label (`usage.kv_policy`, metrics) a policy is reported under;
- `usage`: the KV figures a response's `usage` carries, and how several engine requests' figures add up;
- `metrics`: the `kvpress_*` series both servers export on `/metrics` (names, help, buckets);
- `context_policy`: which policy compresses a chat's default context;
- `limits`: vLLM's request limits (`n`, prompts, stop strings, temperature), which both servers enforce.

This module itself imports nothing heavy: command-line parsers read `OPERATOR_POLICY_HELP` from it.
"""

#: This project's namespace in request bodies: both servers refuse an unknown field in it (a misspelt `kv_polcy`
#: would otherwise serve an uncompressed request), where they ignore other unknown fields as vLLM does.
KV_PREFIX = "kv_"

#: How a request finds a cached compressed prefix (docs/prefix_reuse.md): only by the context it names, or
#: also by the longest stored prefix of its prompt ("auto", multi-turn attach).
PREFIX_MATCHING_MODES = ("named", "auto")
#: What compresses a chat's default context when the request's own policy is not question-agnostic, unless the
#: operator says otherwise (`api/context_policy.py`; both servers).
DEFAULT_CONTEXT_POLICY = "kvzip"

#: What `--kv-policy` takes, in both servers' `--help`.
OPERATOR_POLICY_HELP = (
    "a policy name (snapkv, gvote, full, ...; see `kvpress policies`), a YAML preset path, or JSON such as "
    '\'{"name": "snapkv", "ratio": 0.25}\''
)
