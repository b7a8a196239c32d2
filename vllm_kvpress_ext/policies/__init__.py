"""Compression policies, one per file, and their registry.

`load_policy("snapkv")`, `load_policy({"name": "snapkv", "ratio": 0.1})` or
`load_policy("configs/snapkv.yaml")` give a validated policy instance.
"""

from vllm_kvpress_ext.policies.adakv import AdaKVPolicy
from vllm_kvpress_ext.policies.base import FIELD_LIMITS, KVPolicy, PolicyConfigError
from vllm_kvpress_ext.policies.expected_attention import ExpectedAttentionPolicy
from vllm_kvpress_ext.policies.files import PolicyFiles, allowed_files, set_allowed_files
from vllm_kvpress_ext.policies.full import FullPolicy
from vllm_kvpress_ext.policies.gvote import GVotePolicy
from vllm_kvpress_ext.policies.h2o import H2OPolicy
from vllm_kvpress_ext.policies.kvec import KVECPolicy
from vllm_kvpress_ext.policies.kvzip import KVzipPolicy
from vllm_kvpress_ext.policies.lava import LavaPolicy
from vllm_kvpress_ext.policies.pyramidkv import PyramidKVPolicy
from vllm_kvpress_ext.policies.registry import (
    create_policy,
    load_client_policy,
    load_policy,
    policy_class,
    policy_names,
    register,
)
from vllm_kvpress_ext.policies.snapkv import SnapKVPolicy
from vllm_kvpress_ext.policies.streaming_llm import StreamingLLMPolicy
from vllm_kvpress_ext.policies.wgkv import WGKVPolicy
from vllm_kvpress_ext.policies.xkv import XKVPolicy

_BUILT_IN: tuple[type[KVPolicy], ...] = (
    FullPolicy,
    StreamingLLMPolicy,
    SnapKVPolicy,
    PyramidKVPolicy,
    AdaKVPolicy,
    H2OPolicy,
    ExpectedAttentionPolicy,
    KVzipPolicy,
    GVotePolicy,
    XKVPolicy,
    KVECPolicy,
    LavaPolicy,
    WGKVPolicy,
)
for _policy in _BUILT_IN:
    register(_policy)

__all__ = [
    "FIELD_LIMITS",
    "AdaKVPolicy",
    "ExpectedAttentionPolicy",
    "FullPolicy",
    "GVotePolicy",
    "H2OPolicy",
    "KVECPolicy",
    "KVPolicy",
    "KVzipPolicy",
    "LavaPolicy",
    "PolicyConfigError",
    "PolicyFiles",
    "PyramidKVPolicy",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "WGKVPolicy",
    "XKVPolicy",
    "allowed_files",
    "create_policy",
    "load_client_policy",
    "load_policy",
    "policy_class",
    "policy_names",
    "register",
    "set_allowed_files",
]
