"""What a compare study measures on its runs besides the evaluations it runs (perplexity, passkey: hfpatch eval):
per-block gradient norms during training, the held-out NLL by normalisation statistics, the repeated-span recall
probe, training steps timed side by side, and the summary of a run's training log."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hfpatch.adapters import adapter_for
from hfpatch.apply import unwrap
from hfpatch.lm.causal import logits_nll
from hfpatch.lm.text import documents, tokenize
from hfpatch.norm.batchnorm import batch_statistics
from hfpatch.train.checkpoint import cut_log
from hfpatch.train.config import ConfigError
from hfpatch.train.loop import CausalLMLoss
from hfpatch.utils.timing import medians

from .study import StudyConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# ------------------------------------------------------------------------------------------------ gradient norms

class GradNorms:
    """The gradient norm of each block (and of the embeddings / the final norm and head) at every optimizer step,
    before clipping: each parameter's gradient is read when backward has accumulated it (post-accumulate hooks), and
    the step's row is written when an optimizer steps (torch's global optimizer hook). Rows go to a JSON-lines file
    as they come; a run resumed at `first_step` first cuts it back to the rows up to that step (those of the steps
    after it are computed again), so that each step has one row, from the run that the checkpoints continue."""

    def __init__(self, model: PreTrainedModel, path: Path, first_step: int):
        cut_log(path, first_step)
        target = unwrap(model)
        prefix = "" if target.base_model is target else target.base_model_prefix + "."
        layers = prefix + cast(str, adapter_for(target).layers) + "."  # a model we train has its blocks found
        self.path, self.step = path, first_step
        self.sq: dict = {}
        self.handles = []
        seen = set()
        for name, p in target.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            group = ("layer." + name[len(layers):].split(".")[0] if name.startswith(layers)
                     else "embedding" if p is target.get_input_embeddings().weight else "final")
            self.handles.append(p.register_post_accumulate_grad_hook(self._reader(group, id(p))))
        self.handles.append(register_optimizer_step_pre_hook(self._flush))

    def _reader(self, group: str, key: int):
        def read(p: Any):
            self.sq[key] = (group, float(p.grad.detach().float().pow(2).sum()))  # latest = the accumulated gradient
        return read

    def _flush(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        self.step += 1
        groups: dict[str, float] = {}
        for group, sq in self.sq.values():
            groups[group] = groups.get(group, 0.0) + sq
        self.sq = {}
        row = {"step": self.step, **{g: math.sqrt(v) for g, v in sorted(groups.items(), key=_group_order)}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self):
        for h in self.handles:
            h.remove()


def first_step_gradients(model: PreTrainedModel, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """The gradient norm of every parameter of every block for one batch at the model's current weights (at
    initialisation: the gradients of the first step, before clipping), as the training loop takes it (its loss
    module): {"layer.i": {name inside the block: norm}}. Finer than GradNorms' per-block rows: Xiong et al. 2020's
    analysis is of one weight per block (the feed-forward output, W^FC2)."""
    target = unwrap(model)
    prefix = "" if target.base_model is target else target.base_model_prefix + "."
    layers = prefix + cast(str, adapter_for(target).layers) + "."
    target.train()
    target.zero_grad(set_to_none=True)
    CausalLMLoss(target)(ids)[0].backward()
    out: dict[str, dict[str, float]] = {}
    for name, p in target.named_parameters():
        if name.startswith(layers) and p.grad is not None:
            block, _, inner = name[len(layers):].partition(".")
            out.setdefault(f"layer.{block}", {})[inner] = float(p.grad.detach().float().norm())
    target.zero_grad(set_to_none=True)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split(".")[1])))


def _group_order(item: Any):
    g = item[0]
    return (0, 0) if g == "embedding" else (2, 0) if g == "final" else (1, int(g.split(".")[1]))


def read_jsonl(path: Path) -> list[dict]:
    """Rows by step, the last row of a step winning (a resumed run logs the steps after its checkpoint again)."""
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


# ---------------------------------------------------------------------------------------------------- the models

def held_out_tokens(study: StudyConfig, tok: Any) -> torch.Tensor:
    """The first tokens_per_doc tokens of the evaluation text (its first document that long)."""
    ev = study.evaluate
    for doc in documents(ev.text_files):
        ids = tokenize(tok, doc).ids
        if len(ids) >= ev.tokens_per_doc:
            return torch.as_tensor(ids[: ev.tokens_per_doc].copy())
    raise ConfigError(f"evaluate.text_files: no document has tokens_per_doc={ev.tokens_per_doc} tokens")


def _mean_nll(model: PreTrainedModel, seqs: torch.Tensor, batch: int) -> float:
    """Mean -log p of every token after the first of each sequence, `batch` sequences per forward."""
    total, count = logits_nll(model, seqs, first=1, batch=batch)
    return total / count


def statistics_effect(model: PreTrainedModel, ids: torch.Tensor, seq_len: int, batch: int) -> dict:
    """Held-out NLL of chunks of seq_len: the model in eval() (a batch norm uses its running statistics) at batch
    1 and at the training batch, and with every batch norm using the statistics of the batch it is given
    (batch_statistics) at those sizes. For a model without batch norms all four agree."""
    seqs = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    seqs = seqs[: len(seqs) // batch * batch]  # every batch full, so the four see the same tokens
    model.eval()
    out = {"running_batch1": _mean_nll(model, seqs, 1), f"running_batch{batch}": _mean_nll(model, seqs, batch)}
    with batch_statistics(model):
        out["batchstats_batch1"] = _mean_nll(model, seqs, 1)
        out[f"batchstats_batch{batch}"] = _mean_nll(model, seqs, batch)
    return {"sequences": len(seqs), "seq_len": seq_len, "nll": out}


@torch.no_grad()
def recall(model: PreTrainedModel, ids: torch.Tensor, distances: list[int], span: int = 32, trials: int = 16,
           seed: int = 0,
           limit: int | None = None) -> dict:
    """Can the model use what it read `distance` tokens ago? Span A (held-out text) appears, then `distance` tokens
    of other held-out text, then A again; the control has another span B in A's first place. The gain is the NLL of
    the second A (its tokens after the first) in the control minus in the copy: ~0 when nothing is recalled from
    that far, up to the control NLL when the copy is perfect. Distances whose sequence passes `limit` are skipped."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, float | str]] = {}
    for d in distances:
        total = 2 * span + d
        if limit is not None and total > limit:
            out[str(d)] = {"skipped": f"{total} tokens is past the model's limit of {limit}"}
            continue
        copy_seqs, control_seqs = [], []
        for _ in range(trials):
            a, b, f = (int(torch.randint(0, len(ids) - total, (1,), generator=g)) for _ in range(3))
            A, B, filler = ids[a:a + span], ids[b:b + span], ids[f + span:f + span + d]
            copy_seqs.append(torch.cat([A, filler, A]))
            control_seqs.append(torch.cat([B, filler, A]))
        nll: dict[str, float] = {}
        for name, seqs in (("copy", torch.stack(copy_seqs)), ("control", torch.stack(control_seqs))):
            # the second A's tokens after its first one
            total_nll, count = logits_nll(model, seqs, first=total - span + 1, batch=4)
            nll[name] = total_nll / count
        out[str(d)] = {"copy_nll": nll["copy"], "control_nll": nll["control"], "gain": nll["control"] - nll["copy"]}
    return out


def step_times(models: dict, batch: torch.Tensor, rounds: int) -> dict:
    """Seconds of a training step's forward and backward per model, measured side by side (hfpatch.utils.timing): every
    round times every model once, so a machine that gets busier slows them alike; the median over `rounds` (after
    one round of warm-up)."""
    def step(model: PreTrainedModel):
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()

    return medians({name: (lambda m=model: step(m)) for name, model in models.items()}, rounds, warmup=1)


def unigram_loss(seqs: torch.Tensor) -> float:
    """The entropy (nats) of the token frequencies of `seqs`, counting every token after the first of each sequence
    (the ones a model predicts): the loss of a model that has learnt only how often each token occurs, and nothing
    of the context."""
    counts = torch.bincount(seqs[:, 1:].reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def training_summary(out: Path) -> dict:
    """From the run's log: loss curve, held-out losses, seconds per step, divergence."""
    rows = read_jsonl(out / "log.jsonl")
    if not rows:
        return {}
    losses = [r["loss"] for r in rows]
    seconds = [r["seconds"] for r in rows]
    deltas = [b - a for a, b in itertools.pairwise(seconds) if b > a]  # a resumed run restarts its clock
    smooth = [statistics.fmean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
    finite = all(math.isfinite(x) for x in losses)
    final = smooth[-1] if finite else float("nan")
    return {
        "steps": rows[-1]["step"],
        "loss": losses,
        "eval_loss": {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None},
        "final_loss": final,
        "best_loss": min(smooth) if finite else float("nan"),
        "seconds_per_step": statistics.median(deltas) if deltas else None,
        # fixed before the runs: a loss that is not finite, or that ends 0.5 nats above its best (10-step means)
        "diverged": (not finite) or final > min(smooth) + 0.5,
    }
