"""Who reads and writes the residual stream (for the exact LayerNorm -> RMSNorm conversion, which folds the
centring into every writer): the linear layers inside each block, the embeddings that start the stream, and what
reads the final norm's output.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .reading import LINEARS, Info, combos, is_linear, linear_calls, same


def read_residual(info: Info, layers_top: str, indices: list[int], attention: str | None, mlp: str | None, norms: list,
                  placement: str | None, final_norm: str | None):
    """The residual stream's readers (linears fed by each block norm), writers (linears whose output is added to the
    stream), embedding writers (what starts the stream) and what reads the final norm: what the exact
    LayerNorm -> RMSNorm conversion folds into. ((), ..., reason) when they cannot all be identified, or when the
    blocks differ (a dense block then mixture-of-experts blocks)."""
    if placement != "pre":
        return {}, (), (), (), ("the block norms are not all pre-norms of the residual stream "
                                f"(layout {placement or 'unknown'})")
    if not mlp:
        return {}, (), (), (), "the block has no single MLP module whose output the probe can follow"
    found = [_block_residual(info, f"{layers_top}.{i}.", attention, mlp, norms) for i in indices]
    if any(isinstance(f, str) for f in found):
        return {}, (), (), (), next(f for f in found if isinstance(f, str))
    if any(f != found[0] for f in found):
        return {}, (), (), (), "the blocks read and write the residual stream through different linear layers"
    readers, writers = found[0]
    embedding = _stream_start(info, layers_top)
    if not embedding:
        return {}, (), (), (), ("cannot account for the residual stream's start (embeddings) as the sum of module "
                                "outputs")
    return readers, writers, embedding, _final_readers(info, final_norm), None


def _block_residual(info: Info, block: str, attention: Any, mlp: Any, norms: list):
    """(readers, writers) of one block, or why they cannot be identified."""
    calls = linear_calls(info, block)
    readers = {}
    for n in norms:
        out = info.call(block + n).output
        found = tuple(name[len(block):] for name, c in calls if same(c.input, out))
        if not found:
            return f"cannot find the linear layers that read {n}"
        readers[n] = found
    outs = [info.call(block + attention).output, info.call(block + mlp).output]
    writers = []
    for o in outs:
        hit = [name[len(block):] for name, c in calls if same(c.output, o)]
        if len(hit) != 1:
            return ("a sublayer's output is not the output of one linear layer (e.g. a mixture of experts), so the "
                    "residual stream's writers cannot be centred")
        writers.append(hit[0])
    return readers, tuple(writers)


def _stream_start(info: Info, layers_top: str) -> tuple[str, ...] | None:
    """One or two modules before the first block whose outputs (times a constant) sum to its input."""
    x0 = info.call(f"{layers_top}.0").input
    first = info.call(f"{layers_top}.0").order
    cands = [(n, c) for n, c in info.probe.calls.items()
             if n.startswith(info.prefix) and c.end < first and c.output is not None and c.output.shape == x0.shape
             and isinstance(info.model.get_submodule(n), (nn.Embedding, *LINEARS))]
    embedding = None
    for size in (1, 2):
        for combo in combos(cands, size):
            s = sum(c.output.double() for _, c in combo)
            alpha = float((s * x0.double()).sum() / (s * s).sum().clamp(min=1e-30))
            if same((alpha * s).to(x0.dtype), x0):
                embedding = tuple(info.rel(n) for n, _ in combo)
                break
        if embedding:
            break
    return embedding


def _final_readers(info: Info, final_norm: str | None) -> tuple[str, ...]:
    """What reads the final norm if not the LM head (OPT's project_out)."""
    final_readers: tuple[str, ...] = ()
    if final_norm:
        out = info.call(info.prefix + final_norm).output
        head = info.model.get_output_embeddings()
        readers_f = [n for n, c in info.probe.calls.items() if c.input is not None and same(c.input, out)
                     and is_linear(info.model.get_submodule(n)) and ".base_layer" not in n]
        others = [n for n in readers_f if info.model.get_submodule(n) is not head]
        if others:
            final_readers = tuple(info.rel(n) for n in others)
    return final_readers

