"""The training loop the recipes share, on accelerate: one CPU, DDP, FSDP or DeepSpeed, whatever `accelerate launch`
was given.

- Loss: the causal-LM loss (and, when a teacher is given, the KL to it) scored chunk by chunk (losses.py) inside a
  module that accelerate wraps, so DDP/FSDP see a normal forward.
- Gradient accumulation by hand (no_sync on all but the last micro-batch), clipping, AdamW, linear warm-up + cosine
  decay stepped once per optimizer step (an accelerate-prepared scheduler would step once per process).
- Data order: batch `step` is a pure function of (seed, step) (data.batch_indices), each process taking its slice;
  so are PoSE's position ids (pose.py), per sequence.
- Memory options (memory.py): activation checkpointing, the tiled MLP; the chunked loss (losses.py).
- A checkpoint every `save_every` steps (accelerate's save_state: model, optimizer, RNG states; the step and the
  scheduler in a JSON marker), published by one rename once complete (checkpoint.py); resuming loads the newest
  complete one and continues at the next step, so a run killed at any moment ends with the uninterrupted loss curve.
- Logs: output_dir/log.jsonl and accelerate's trackers (main process); a tqdm bar on the main process only.
- The end: hfpatch.save_pretrained(output_dir/final) — LoRA adapters are merged first — which hfpatch.from_pretrained
  reloads with its patches; written as final.partial and renamed, so a folder named final is always complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedConfig, PreTrainedModel, get_cosine_schedule_with_warmup

import hfpatch

from ..lm.causal import softcap, softcap_of
from ..models import model_fingerprint
from ..utils.files import write_whole
from . import checkpoint, memory, parallel
from .config import ConfigError, RecipeConfig, RunFailed
from .data import batch_indices
from .losses import auto_chunk, chunked_lm_loss, fused_lm_loss, shift
from .pose import batch_position_ids


def output_head(lm: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden states -> logits, as the model's own forward does after its base model (gemma2/3 softcap them)."""
    head, cap = lm.get_output_embeddings(), softcap_of(lm.config)
    return head if not cap else lambda h: softcap(head(h), cap)


FUSED_CHUNK = 512  # positions per chunk of the fused loss when loss_chunk is not set


class CausalLMLoss(nn.Module):
    """Wraps the trained model so that accelerate's wrappers (DDP, FSDP, DeepSpeed) see one forward that returns
    the loss. The teacher is a plain attribute, not a submodule: it is neither trained, synchronised, sharded nor
    saved."""

    def __init__(self, model: nn.Module, chunk: int | None = None, teacher: nn.Module | None = None,
                 alpha: float = 0.0, temperature: float = 1.0, fused: bool = False) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "teacher", teacher)
        self.chunk, self.alpha, self.temperature, self.fused = chunk, alpha, temperature, fused

    @property
    def config(self) -> PreTrainedConfig:
        """The model's config: DeepSpeed's Ulysses reads the attention layout from the module it is given."""
        return hfpatch.apply.unwrap(self.model).config

    @property
    def _no_split_modules(self) -> list[str]:
        """The classes of the model's blocks, patched ones included (a placement patch gives them a subclass):
        accelerate's FSDP wraps each block by these names."""
        lm = hfpatch.apply.unwrap(self.model)
        blocks = hfpatch.adapters.get_path(lm.base_model, hfpatch.adapters.adapter_for(lm).layers)
        return sorted({type(block).__name__ for block in blocks})

    def forward(self, ids, position_ids=None, labels=None, scale=None):
        """(loss, ce, kl), means over the scored positions of `ids`. `labels` default to the next tokens of `ids`;
        with `scale`, each is (sum over this piece) x scale instead: a piece of a sequence split over processes."""
        lm = hfpatch.apply.unwrap(self.model)
        chunk = auto_chunk(ids.shape[0], ids.shape[1], lm.config.get_text_config().vocab_size, self.chunk)
        extra = {}
        if position_ids is not None:
            # An explicit all-ones mask: without one, transformers reads positions that jump (PoSE's skips, a
            # shard of a split sequence) as the starts of separate packed documents and masks attention between them
            extra = {"position_ids": position_ids, "attention_mask": torch.ones_like(ids)}
        hidden = lm.base_model(input_ids=ids, use_cache=False, **extra).last_hidden_state
        labels = shift(ids) if labels is None else labels
        if self.fused and self.teacher is None:  # gradients made in the forward pass, chunk by chunk (losses.py)
            out = fused_lm_loss(hidden, labels, lm.get_output_embeddings(), self.chunk or FUSED_CHUNK,
                                softcap_of(lm.config))
        else:
            teacher_hidden = teacher_head = None
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_hidden = self.teacher.base_model(input_ids=ids, use_cache=False).last_hidden_state
                teacher_head = output_head(self.teacher)
            out = chunked_lm_loss(hidden, labels, output_head(lm), chunk, teacher_hidden, teacher_head,
                                  self.temperature, self.alpha if self.teacher is not None else 0.0)
        if scale is None:
            return out
        scored = (labels != -100).sum()
        return tuple(x * scored * scale for x in out)


class Progress:
    """What accelerate checkpoints besides model/optimizer/scheduler/RNG: the step reached and tokens seen."""

    def __init__(self) -> None:
        self.step, self.tokens = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


class Run:
    """What a training run holds besides the model: built by `prepare`, stepped by `train_step`."""

    def __init__(self, accelerator, loss_module, optimizer, scheduler, params, memory_edits) -> None:
        self.accelerator, self.loss_module, self.optimizer = accelerator, loss_module, optimizer
        self.scheduler, self.params, self.memory_edits = scheduler, params, memory_edits
        self.layout = parallel.layout(accelerator)

    @contextlib.contextmanager
    def pieces(self, ids, positions) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                       torch.Tensor | None]]:
        """The loss module's arguments (ids, positions, labels, scale) for one micro-batch: the whole sequences, or
        this process's shard of them (parallel.py). The forward and the backward pass both run inside (context
        parallelism's ring attention is active there)."""
        lay = self.layout
        if lay.split is None:
            yield ids, positions, None, None
            return
        labels = shift(ids)  # before the split: a shard's last label is the next shard's first token
        scale = lay.size / (labels != -100).sum()  # shard's sum x size / all scored; averaged -> the batch's mean
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        if lay.split == "sp":
            ids, labels, positions = parallel.contiguous_shard(lay, ids, labels, positions)
            yield ids, positions, labels, scale
            return
        buffers = [ids, labels, positions]  # sharded in place by torch's context_parallel
        with self.accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                     no_restore_buffers=set(buffers)):
            yield ids, positions, labels, scale


def prepare(cfg: RecipeConfig, model: nn.Module, teacher: nn.Module | None = None) -> Run:
    """The accelerator, the memory options on the model, LoRA, the loss module, AdamW and the schedule, prepared."""
    # cpu=True where there is no GPU: processes started by torchrun (accelerate's multi-process launcher) then
    # form a gloo group on the CPU instead of failing to find devices
    accelerator = Accelerator(mixed_precision=cfg.precision, log_with=cfg.log_with, project_dir=cfg.output_dir,
                              cpu=not torch.cuda.is_available())
    set_seed(cfg.seed)
    if cfg.release_memory and accelerator.device.type == "cpu":
        memory.release_freed_memory()
    memory_edits = memory.apply(model, gradient_checkpointing=cfg.gradient_checkpointing, mlp_tile=cfg.mlp_tile)
    if cfg.lora.enabled:
        import peft  # the optional extra (pip install peft): only LoRA runs need it

        targets = cfg.lora.target_modules
        try:
            model = peft.get_peft_model(model, peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                               lora_dropout=cfg.lora.dropout, target_modules=targets))
        except ValueError as e:  # e.g. target modules the model does not have
            memory_edits.undo()
            raise ConfigError(f"lora: {' '.join(str(e).split())}") from None
    distill = cfg.distillation()
    loss_module = CausalLMLoss(model, chunk=cfg.loss_chunk, teacher=teacher,
                               alpha=distill.alpha if distill else 0.0,
                               temperature=distill.temperature if distill else 1.0, fused=cfg.fused_loss)
    fused: dict[str, Any] = {"fused": True} if cfg.fused_optimizer else {}
    optimizer = torch.optim.AdamW([p for p in loss_module.parameters() if p.requires_grad], lr=cfg.lr,
                                  betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay, **fused)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
    loss_module, optimizer = accelerator.prepare(loss_module, optimizer)
    params = [p for p in loss_module.parameters() if p.requires_grad]  # after prepare: FSDP2 replaces them
    if teacher is not None:
        teacher.to(accelerator.device).eval().requires_grad_(False)
    return Run(accelerator, loss_module, optimizer, scheduler, params, memory_edits)


def train_step(cfg: RecipeConfig, run: Run, train_seqs: torch.Tensor, step: int) -> torch.Tensor:
    """Optimizer step `step` (0-based): cfg.grad_accum micro-batches of this process's rows of the global batch
    (with their PoSE positions), gradients synchronised on the last one, clipping, AdamW, the schedule. Returns
    this process's (loss, ce, kl), averaged over the micro-batches."""
    accelerator, loss_module = run.accelerator, run.loss_module
    # processes that split one sequence between them (parallel.py) train on the same rows
    rank, world, bs = run.layout.data_rank, run.layout.data_size, cfg.batch_size
    pose = cfg.pose_positions()
    loss_module.train()
    totals = torch.zeros(3, device=accelerator.device)
    for a in range(cfg.grad_accum):
        micro = step * cfg.grad_accum + a
        idx = batch_indices(len(train_seqs), bs * world, micro, cfg.seed)[rank * bs:(rank + 1) * bs]
        ids = train_seqs[idx].to(accelerator.device)
        positions = None
        if pose:  # numbered like the data: sequence (micro-batch * global batch + rank * bs + row) of the run
            target_len, chunks = pose
            positions = batch_position_ids(cfg.seq_len, target_len, chunks, cfg.seed,
                                           micro * bs * world + rank * bs, len(idx)).to(accelerator.device)
        sync = a == cfg.grad_accum - 1
        ctx = accelerator.no_sync(loss_module) if not sync else contextlib.nullcontext()
        with ctx, run.pieces(ids, positions) as pieces:
            loss, ce, kl = loss_module(*pieces)
            accelerator.backward(loss / cfg.grad_accum)
        totals += torch.stack([loss.detach(), ce.detach(), kl.detach()]).float() / cfg.grad_accum
    # checked before the optimizer steps: NaN gradients would make every weight NaN. Summed over the processes, so
    # that every process sees the same answer and they stop together
    if not torch.isfinite(accelerator.reduce(totals.clone(), reduction="sum")).all():
        raise NotFinite(f"the loss is {totals[0].item()}")
    if cfg.clip:
        norm = accelerator.clip_grad_norm_(run.params, cfg.clip)
        if norm is not None and not torch.isfinite(torch.as_tensor(norm)).all():
            raise NotFinite(f"the gradient norm is {float(norm)}")
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return totals


# Config keys a resumed run may change: they decide when to save, evaluate or stop, how memory is spent (never the
# arithmetic of a step: memory.py), where output goes, or where the model and data are read from (their content is
# compared instead). Every other key decides the training: a resume with another value is refused.
MAY_CHANGE = {"resume", "stop_after", "log_with", "output_dir", "save_every", "eval_every", "memory_check",
              "gradient_checkpointing", "loss_chunk", "mlp_tile", "fused_loss", "release_memory", "fused_optimizer",
              "trust_remote_code", "allow_pickled_weights", "model", "tokenizer", "data.text_files"}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):  # an empty section adds nothing: {} and an unset section are the same
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


# Keys added after checkpoints already existed, with the value every run had before they did: at that value they are
# left out of the identity, so that those checkpoints still resume (any other value is compared like every key).
ADDED_KEYS = {"adam_beta2": 0.999, "init": "hf", "calibrate": 0}


def run_identity(cfg: RecipeConfig, train_seqs: torch.Tensor, eval_seqs: torch.Tensor) -> dict:
    """What makes a run the run it is, kept in every checkpoint marker and compared on resume: its settings (the
    keys outside MAY_CHANGE), a SHA-256 of its packed data (the tokens of both splits: the files' content, the
    tokenizer, seq_len and the split all decide them) and the starting model's files by content."""
    data = hashlib.sha256()
    for seqs in (train_seqs, eval_seqs):
        data.update(repr(tuple(seqs.shape)).encode())
        data.update(seqs.contiguous().numpy().tobytes())
    settings = {k: v for k, v in _flat(cfg.as_dict()).items()
                if k not in MAY_CHANGE and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}
    return {"settings": json.loads(json.dumps(settings, default=str)),  # as the marker will hold it (a YAML date)
            "data": data.hexdigest(), "model_files": model_fingerprint(cfg.model) if cfg.model else None}


def _states_agree(info: dict) -> str | None:
    """The marker's step counter and LR schedule at the marker's step (an edited marker is not resumed from)."""
    step, states = info["step"], info["states"]
    at = states["progress"].get("step")
    if at != step:
        return f"its progress is at step {at}, not {step} as its marker says"
    at = states["scheduler"].get("last_epoch")
    if at != step:
        return f"its LR schedule is at step {at}, not {step}"
    return None


def _optimizer_agrees(run: Run) -> Callable[[int], str | None]:
    """After loading: AdamW counts its own steps; they must be the marker's."""
    def check(step: int) -> str | None:
        optimizer = getattr(run.optimizer, "optimizer", run.optimizer)  # inside accelerate's wrapper
        try:
            counts = {int(s["step"]) for s in optimizer.state.values() if isinstance(s, dict) and "step" in s}
        except Exception:  # an optimizer that keeps no such count (DeepSpeed's): nothing to compare, not a refusal
            return None
        if counts and max(counts) != step:
            return f"the optimizer state has made {max(counts)} steps, the marker says {step}"
        return None
    return check


class NotFinite(Exception):
    """A step whose loss or gradient is no longer a finite number (train() says which step)."""


def weights_finite(run: Run) -> bool:
    """Every trained weight finite, on every process (a checkpoint of inf weights is no checkpoint to go back to)."""
    bad = torch.zeros((), device=run.accelerator.device)
    for p in run.params:
        local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard
        if not torch.isfinite(local.detach()).all():
            bad += 1
            break
    return run.accelerator.reduce(bad, reduction="sum").item() == 0


def _stopped(step: int, what: str, root: Path, saved: int) -> RunFailed:
    kept = f"the last good checkpoint step_{saved} is kept in {root}" if saved else "no checkpoint was written"
    return RunFailed(f"training stopped at step {step}: {what}; {kept}. Lower lr (or set clip) and start again in "
                     "another output_dir")


def train(cfg: RecipeConfig, model: nn.Module, tok: Any, train_seqs: torch.Tensor, eval_seqs: torch.Tensor,
          teacher: nn.Module | None = None) -> dict:
    _check_memory(cfg, model, teacher)
    run = prepare(cfg, model, teacher)
    out = Path(cfg.output_dir)
    progress = Progress()
    states = {"progress": progress, "scheduler": run.scheduler}  # saved as JSON in the checkpoint marker
    identity = run_identity(cfg, train_seqs, eval_seqs)
    saved = _resume(cfg, run, states, identity) if cfg.resume else 0  # the step of the last checkpoint
    if run.accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        run.accelerator.init_trackers("hfpatch", config={k: v for k, v in cfg.as_dict().items()
                                                            if not isinstance(v, dict)})
    last = _train_steps(cfg, run, train_seqs, eval_seqs, progress, states, identity, saved)
    run.accelerator.wait_for_everyone()
    final = None
    if progress.step >= cfg.max_steps:
        final = save_final(cfg, run.accelerator, run.loss_module, tok, out / "final")
    run.accelerator.wait_for_everyone()  # the processes leave together: none tears down the group while one saves
    finish(run)
    run.memory_edits.undo()
    return {"step": progress.step, "last": last, "final": str(final) if final else None}


def _check_memory(cfg: RecipeConfig, model: nn.Module, teacher: nn.Module | None) -> None:
    """Refuse a run that would not fit in memory (memory_check=false skips it), as a config error."""
    if not cfg.memory_check:
        return
    try:
        memory.check_fits(cfg, model, teacher)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _resume(cfg: RecipeConfig, run: Run, states: dict, identity: dict) -> int:
    """Load the checkpoint `cfg.resume` names into the run; its step. A checkpoint that does not fit this run ends
    the run's distributed state and memory options before the error goes up."""
    out = Path(cfg.output_dir)
    try:
        return checkpoint.resume(run.accelerator, cfg.resume, out, states, out / "log.jsonl", identity, _states_agree,
                                 _optimizer_agrees(run))
    except ConfigError:
        finish(run)
        run.memory_edits.undo()
        raise


def _train_steps(cfg: RecipeConfig, run: Run, train_seqs: torch.Tensor, eval_seqs: torch.Tensor,
                 progress: Progress, states: dict, identity: dict, saved: int) -> dict:
    """The steps from progress.step to max_steps (or stop_after), each logged and, when due, evaluated and
    checkpointed; the last step's log line."""
    accelerator, out = run.accelerator, Path(cfg.output_dir)
    tokens_per_step = cfg.batch_size * run.layout.data_size * cfg.grad_accum * cfg.seq_len
    bar = tqdm(total=cfg.max_steps, initial=progress.step, disable=not accelerator.is_main_process, desc="train")
    t_start, last = time.perf_counter(), {}
    try:
        while progress.step < cfg.max_steps:
            try:
                totals = train_step(cfg, run, train_seqs, progress.step)
            except NotFinite as e:
                raise _stopped(progress.step + 1, str(e), out / "checkpoints", saved) from None
            progress.step, progress.tokens = progress.step + 1, progress.tokens + tokens_per_step
            last = _step_line(cfg, run, eval_seqs, progress, totals, time.perf_counter() - t_start)
            if accelerator.is_main_process:
                _log_step(accelerator, out / "log.jsonl", last, bar)
            if progress.step % cfg.save_every == 0 or progress.step == cfg.max_steps:
                if not weights_finite(run):
                    raise _stopped(progress.step, "a weight is no longer finite", out / "checkpoints", saved)
                checkpoint.save(accelerator, out / "checkpoints", progress.step, states, identity)
                saved = progress.step
            if cfg.stop_after is not None and progress.step >= cfg.stop_after:
                break
    except RunFailed:  # every process stops at the same step: they end together
        bar.close()
        finish(run)
        run.memory_edits.undo()
        raise
    except (OSError, KeyboardInterrupt):  # a full disk, Ctrl-C: the line that says so starts on a line of its own
        bar.close()
        raise
    bar.close()
    return last


def _step_line(cfg: RecipeConfig, run: Run, eval_seqs: torch.Tensor, progress: Progress, totals: torch.Tensor,
               elapsed: float) -> dict:
    """The log line of the step just made: its losses averaged over the processes, and the eval loss when due."""
    totals = run.accelerator.reduce(totals, reduction="mean")
    line = {"step": progress.step, "loss": totals[0].item(), "ce": totals[1].item(), "kl": totals[2].item(),
            "lr": run.scheduler.get_last_lr()[0], "tokens": progress.tokens, "seconds": round(elapsed, 3)}
    if progress.step % cfg.eval_every == 0 or progress.step == cfg.max_steps:
        line["eval_loss"] = evaluate(cfg, run.loss_module, eval_seqs, run.accelerator)
    return line


def _log_step(accelerator: Accelerator, log: Path, line: dict, bar: Any) -> None:
    """The step's line appended to log.jsonl, sent to the trackers and shown on the progress bar (main process)."""
    with log.open("a") as f:
        f.write(json.dumps(line) + "\n")
    accelerator.log(line, step=line["step"])
    bar.set_postfix(loss=f"{line['loss']:.4f}")
    bar.update(1)


def finish(run: Run) -> None:
    """End the run's distributed state in a safe order. DDP's reducer holds a reference to the process group;
    dropped first, while the group is still registered, it leaves the group's last reference to end_training's
    destroy_process_group, which releases the GIL while gloo's threads stop. Dropped afterwards (when the run goes
    out of scope), the group is destroyed from the reducer's destructor with the GIL held; a gloo thread still
    freeing the last collective's tensors then waits for the GIL forever: rank 0 hung at exit that way in the test
    suite under load (the pybind11 destructor problem of torch issue #56297)."""
    run.loss_module = run.optimizer = run.params = None
    run.accelerator.free_memory()  # accelerate's own references to the prepared model and optimizer, then gc
    run.accelerator.end_training()


@torch.no_grad()
def evaluate(cfg: RecipeConfig, loss_module: nn.Module, eval_seqs: torch.Tensor,
             accelerator: Accelerator) -> float | None:
    """Mean CE per token over the first eval_batches x world x batch_size held-out sequences."""
    if len(eval_seqs) == 0:
        return None
    loss_module.eval()
    rank, world, bs = accelerator.process_index, accelerator.num_processes, cfg.batch_size
    n = min(len(eval_seqs), cfg.eval_batches * bs * world)
    total = torch.zeros(2, device=accelerator.device)
    for start in range(rank * bs, n, bs * world):
        ids = eval_seqs[start:start + bs].to(accelerator.device)
        _, ce, _ = loss_module(ids)
        scored = float((ids.shape[1] - 1) * ids.shape[0])
        total += torch.stack([ce.float() * scored, ce.new_tensor(scored, dtype=torch.float32)])
    total = accelerator.reduce(total, reduction="sum")
    loss_module.train()
    return (total[0] / total[1].clamp(min=1)).item()


def save_final(cfg: RecipeConfig, accelerator: Accelerator, loss_module: nn.Module, tok: Any,
               path: Path) -> Path | None:
    state = accelerator.get_state_dict(loss_module)  # gathered in full under FSDP / ZeRO-3
    if not accelerator.is_main_process:
        return None
    model = accelerator.unwrap_model(loss_module).model
    if hasattr(model, "merge_and_unload"):  # LoRA: fold the adapters into the weights
        model = model.merge_and_unload()
        state = None
    else:
        state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    # written as final.partial, renamed to `path` once complete; a full disk is an OSError naming `path`
    return write_whole(path, lambda tmp: hfpatch.save_pretrained(
        model, tmp, tokenizer=tok, **({"state_dict": state} if state is not None else {})))
