"""The plan an evaluation makes of its work, as the sweep (sweep.py) runs it: cells (`Cell`, one per patch spec and
coordinates) of units (`Unit`, one document, one trial), with what decides the numbers (`Plan`). Data only: the
evaluations (through definition.py), the sweep and the engines (engines.py) all read it, and it imports nothing, so
that none of them imports another back to reach it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Unit:
    id: object  # stored in the unit's record under Evaluation.unit_key (a document name, a trial number)
    # the forwards it makes, for the time estimate: (tokens read, keys the last one attends to, positions through
    # the LM head)
    forwards: list[tuple[int, int, int]]
    data: object = None  # whatever run_unit needs

    @property
    def tokens(self) -> int:
        return sum(f[0] for f in self.forwards)


def decoding(prompt_tokens: int, new_tokens: int) -> list[tuple[int, int, int]]:
    """The forwards of greedy decoding, for Unit.forwards: the prompt, then one token at a time."""
    return [(prompt_tokens, prompt_tokens, 1)] + [(1, prompt_tokens + k, 1) for k in range(1, new_tokens)]


@dataclass
class Cell:
    key: dict  # its coordinates besides the patch spec, e.g. {"windowing": "chunks", "length": 2048}
    units: list[Unit]
    fields: dict = field(default_factory=dict)  # stored with the cell when it is created


@dataclass
class Plan:
    identity: dict  # what decides the numbers besides the coordinates: a results file is continued only if equal
    cells: list[Cell]
    read: int  # the most tokens the model reads in one forward
    new_tokens: int = 0  # tokens generated after such a read (0: no generation, no KV cache)
    score_chunk: int = 0  # positions per LM-head chunk when scoring (0: only the last position goes through it)
    info: dict = field(default_factory=dict)  # stored at the top of the results file (settings, corpus, ...)
