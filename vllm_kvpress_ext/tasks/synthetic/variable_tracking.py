"""Variable tracking: chains of assignments hidden in filler (multi-hop tracing).

Each chain starts with ``var xA = 53 .`` and continues ``var xB = xA .``, ``var xC = xB .`` ... Every
assignment of the queried chain is evidence: dropping any hop breaks the trace, which is what makes this
family sensitive to compression even when each hop looks unremarkable. Assignments of one chain appear
in chain order; chains are interleaved at random.

Two queries:

- ``"variables"``: ``which variables equal 53 ? answer :`` -> the chain's variables in assignment order.
- ``"value"``: ``what is var xC ? answer :`` (xC = the chain's last variable) -> ``53``.

Example (``context_length=None``, 2 chains of 2)::

    context:  var x5 = 53 . var x9 = 17 . var x2 = x5 . var x7 = x9 .
    question: which variables equal 53 ? answer :
    answer:   x5 , x2
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from ..tokenizer import VALUE_WORDS, VARIABLE_WORDS
from .base import ANSWER_CUE, Sample, join, join_items, require, require_int
from .haystack import HaystackParams, filler_budget, layout, measured_budget, validate_depth

VariableQuery = Literal["variables", "value"]
STATEMENT_LENGTH = 5
QUESTION_LENGTH = 7


@dataclass(frozen=True, kw_only=True)
class VariableTracking(HaystackParams):
    """Parameters (defaults in brackets).

    - ``num_chains`` [2]: independent chains (one queried, the others distract).
    - ``chain_length`` [4]: variables per chain (``chain_length - 1`` hops).
    - ``query`` ["variables"]: ``"variables"`` or ``"value"`` (see the module docstring).
    - ``num_variables`` [64]: variable pool size (first N of ``x0..x63``).
    - ``num_values`` [100]: value pool size (first N of ``0..99``); chains get distinct values.
    - ``depth`` [None]: if given, the queried chain's assignments sit together at this fraction of the
      filler; ``None`` scatters them.
    - inherited: ``context_length`` [256], ``filler`` ["random"].
    """

    name: ClassVar[str] = "variable_tracking"

    num_chains: int = 2
    chain_length: int = 4
    query: VariableQuery = "variables"
    num_variables: int = len(VARIABLE_WORDS)
    num_values: int = len(VALUE_WORDS)
    depth: float | None = None

    def validate(self) -> None:
        super().validate()
        require_int("num_chains", self.num_chains, 1)
        require_int("chain_length", self.chain_length, 1)
        queries = get_args(VariableQuery)
        require(self.query in queries, f"query must be one of {queries}, got {self.query!r}")
        require_int("num_variables", self.num_variables, 1)
        require(
            self.num_variables <= len(VARIABLE_WORDS),
            f"num_variables must be <= {len(VARIABLE_WORDS)}, got {self.num_variables}",
        )
        require(
            self.num_chains * self.chain_length <= self.num_variables,
            f"{self.name}: num_chains * chain_length = {self.num_chains * self.chain_length} distinct variables "
            f"needed but num_variables={self.num_variables}",
        )
        require_int("num_values", self.num_values, 1)
        require(self.num_values <= len(VALUE_WORDS), f"num_values must be <= {len(VALUE_WORDS)}, got {self.num_values}")
        require(
            self.num_chains <= self.num_values,
            f"{self.name}: num_chains={self.num_chains} needs distinct values but num_values={self.num_values}",
        )
        validate_depth(self.depth)
        filler_budget(self.name, self.context_length, self._needed())

    def _needed(self) -> int:
        return self.num_chains * self.chain_length * STATEMENT_LENGTH + QUESTION_LENGTH

    def _generate(self, rng: random.Random) -> Sample:
        names = rng.sample(VARIABLE_WORDS[: self.num_variables], self.num_chains * self.chain_length)
        chains = [names[c * self.chain_length : (c + 1) * self.chain_length] for c in range(self.num_chains)]
        values = rng.sample(VALUE_WORDS[: self.num_values], self.num_chains)

        # A random interleaving of the chains that keeps each chain's assignments in order.
        turn_order = [c for c in range(self.num_chains) for _ in range(self.chain_length)]
        rng.shuffle(turn_order)
        blocks: list[list[str]] = []
        groups: list[list[int]] = [[] for _ in chains]
        hop = [0] * self.num_chains
        for c in turn_order:
            var = chains[c][hop[c]]
            source = values[c] if hop[c] == 0 else chains[c][hop[c] - 1]
            groups[c].append(len(blocks))
            blocks.append(["var", var, "=", source, "."])
            hop[c] += 1

        if self.query == "variables":
            question = ["which", "variables", "equal", values[0], "?", *ANSWER_CUE]
            answer = join_items([[v] for v in chains[0]])
        else:
            question = ["what", "is", "var", chains[0][-1], "?", *ANSWER_CUE]
            answer = values[0]
        words, spans = layout(
            rng,
            blocks,
            n_filler=measured_budget(self.name, self.context_length, blocks, question),
            kind=self.filler,
            needles=groups[0],
            depth=self.depth,
            ordered=groups,
        )
        return Sample(
            task=self.name,
            context=join(words),
            question=join(question),
            answer=answer,
            metadata={
                "evidence": [list(spans[i]) for i in groups[0]],
                "chain": chains[0],
                "value": values[0],
                "query": self.query,
                "num_context_tokens": len(words),
            },
        )
