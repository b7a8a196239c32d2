"""Policies at a memory budget, as every bench builds them.

- `budgets_for`: the budgets a policy runs at (budget-free policies and `full` once);
- `make_policy`: a policy (name or preset) with its `ratio` field set to a budget (`with_ratio`);
- `budgeted_policy`: a policy at `ratio` of a given prompt, WG-KV included (its cap);
- `policy_label`: how a policy is named in a bench's results.
"""

from __future__ import annotations

from pathlib import Path

from vllm_kvpress_ext.policies import KVPolicy, create_policy, load_policy, policy_class
from vllm_kvpress_ext.policies.wgkv import DEFAULT_WINDOW


def budgets_for(policy: str, budgets: tuple[float, ...]) -> list[float | None]:
    """Budget-free policies (and `full`) run once; the others once per ratio.

    `policy` is a registered name or a YAML preset path (e.g. WG-KV with a given gate file).
    """
    resolved = load_policy(policy)
    if resolved is None or resolved.name == "full":
        return [None]
    fields = getattr(policy_class(resolved.name), "__dataclass_fields__", {})
    return list(budgets) if "ratio" in fields else [None]


def policy_label(policy: str) -> str:
    """How a policy is named in the results: its name, or a preset file's stem (`wgkv-lambda0.1.yaml` -> ...)."""
    path = Path(policy)
    return path.stem if path.suffix in (".yaml", ".yml") else policy


def with_ratio(policy: KVPolicy, ratio: float) -> KVPolicy:
    """`policy` with every hyperparameter as it is but its `ratio`."""
    return create_policy(policy.name, **{**policy.params(), "ratio": ratio})


def make_policy(policy: str, budget: float | None) -> KVPolicy:
    """The policy (name or preset) with its ratio set to `budget` when one is given."""
    resolved = load_policy(policy)
    assert resolved is not None
    return resolved if budget is None else with_ratio(resolved, budget)


def budgeted_policy(name: str, ratio: float, prompt_len: int) -> KVPolicy:
    """`name` at `ratio` of the prompt: its `ratio` field, WG-KV's cap, or its defaults when budget-free."""
    if name == "wgkv":
        cap = max(1, round(ratio * prompt_len) - DEFAULT_WINDOW)
        return create_policy(name, cap=cap, local_window=DEFAULT_WINDOW)
    default = create_policy(name)
    return create_policy(name, ratio=ratio) if "ratio" in default.params() and name != "full" else default
