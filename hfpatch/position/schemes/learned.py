"""position="learned": a trainable absolute position table (GPT-2's kind) for a model that has none.

The model's own position signal is taken out (RoPE becomes the identity: patch.remove_positions), and the first block
gets a mixin that adds row p of a new table to the input at position p (from the `position_ids` the decoder passes
it, so cached decoding stays right). The table has `table_size` rows (default: the model's
max_position_embeddings, its trained window), drawn from N(0, init_std²) with init_std = 0.02 by default (GPT-2's
initializer range): small next to the token embeddings. The model's length limit becomes the table size:
config.max_position_embeddings is set to it (hfpatch.introspect.position_limit reads it), and a position past the table
is refused with a clear error, where GPT-2's own table fails with an index error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...adapters import Adapter, get_path
from ...edits import Edits
from .absolute import check_table_fits
from .removal import remove_positions

TABLE_ATTR = "hfpatch_position_table"  # on the first block: the nn.Embedding


class LearnedInput:
    """Mixed into the first block: adds the table's row at `position_ids` to its input."""

    def forward(self, hidden_states, *args, **kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("position='learned' needs the decoder to pass position_ids to its first block")
        table = getattr(self, TABLE_ATTR)
        n = table.num_embeddings
        if position_ids.numel() and (int(position_ids.max()) >= n or int(position_ids.min()) < 0):
            raise ValueError(f"position='learned': position {int(position_ids.max())} is past the learned position "
                             f"table, which has {n} rows (positions 0..{n - 1}): the model's length limit is {n} "
                             "tokens (set by table_size when patching)")
        pe = table(position_ids.to(table.weight.device)).to(device=hidden_states.device, dtype=hidden_states.dtype)
        return super().forward(hidden_states + pe, *args, **kwargs)


def apply_learned(model: Any, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    size = req.get("table_size") or adapter.window
    if size is None:
        raise ValueError(f"position='learned' sizes its table by the trained window, and {adapter.model_type}'s config "
                         "names none (no max_position_embeddings): pass table_size=")
    config = model.config
    like = model.get_input_embeddings().weight
    check_table_fits(size, config.get_text_config().hidden_size, like, f"position='learned' with table_size={size}")
    remove_positions(model, adapter, req["scheme"], edits, reloadable=True)
    table = nn.Embedding(size, config.get_text_config().hidden_size, dtype=like.dtype, device=like.device)
    with torch.no_grad():
        table.weight.normal_(0.0, req.get("init_std", 0.02))
    first = get_path(model.base_model, adapter.layers)[0]
    edits.set(first, TABLE_ATTR, table)
    edits.mix_in(first, LearnedInput)
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        edits.set(c, "max_position_embeddings", size)
