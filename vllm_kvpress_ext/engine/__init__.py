"""Embedded continuous-batching engine over the paged per-head cache.

`LLM` is the offline API; `LLMEngine` is the step API a server drives.
"""

from vllm_kvpress_ext.engine.engine import LLMEngine, RequestRejectedError
from vllm_kvpress_ext.engine.inputs import ContextQuestion
from vllm_kvpress_ext.engine.kept import KeptEntries
from vllm_kvpress_ext.engine.llm import LLM
from vllm_kvpress_ext.engine.request import KVStats, RequestOutput
from vllm_kvpress_ext.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "ContextQuestion",
    "KVStats",
    "KeptEntries",
    "LLMEngine",
    "RequestOutput",
    "RequestRejectedError",
    "SamplingParams",
]
