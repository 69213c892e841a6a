"""The training loop the recipes share, on accelerate: one CPU, DDP, FSDP or DeepSpeed, whatever `accelerate launch`
was given.

- Loss: the causal-LM loss (and, when a teacher is given, the KL to it) scored chunk by chunk (losses.py) inside a
  module that accelerate wraps, so DDP/FSDP see a normal forward.
- Gradient accumulation by hand (no_sync on all but the last micro-batch), clipping, AdamW, linear warm-up + cosine
  decay stepped once per optimizer step (an accelerate-prepared scheduler would step once per process).
- Data order: batch `step` is a pure function of (seed, step) (data.batch_indices), each process taking its slice.
- A checkpoint every `save_every` steps (accelerate's save_state: model, optimizer, RNG states; the step and the
  scheduler in a JSON marker), published by one rename once complete (checkpoint.py); resuming loads the newest
  complete one and continues at the next step, so a run killed at any moment ends with the uninterrupted loss curve.
- Logs: output_dir/log.jsonl and accelerate's trackers (main process); a tqdm bar on the main process only.
- The end: hfpatch.save_pretrained(output_dir/final) — LoRA adapters are merged first — which hfpatch.from_pretrained
  reloads with its patches; written as final.partial and renamed, so a folder named final is always complete.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

import hfpatch

from . import checkpoint
from .config import ConfigError
from .data import batch_indices
from .losses import auto_chunk, chunked_lm_loss, shift


def output_head(lm):
    """hidden states -> logits, as the model's own forward does after its base model (gemma2/3 softcap them)."""
    head = lm.get_output_embeddings()
    cap = getattr(lm.config, "final_logit_softcapping", None)
    if not cap:
        return head
    return lambda h: torch.tanh(head(h) / cap) * cap


class CausalLMLoss(nn.Module):
    """Wraps the trained model so that accelerate's wrappers (DDP, FSDP) see one forward that returns the loss.
    The teacher is a plain attribute, not a submodule: it is neither trained, synchronised, sharded nor saved."""

    def __init__(self, model, chunk=None, teacher=None, alpha=0.0, temperature=1.0):
        super().__init__()
        self.model = model
        object.__setattr__(self, "teacher", teacher)
        self.chunk, self.alpha, self.temperature = chunk, alpha, temperature

    def forward(self, ids):
        lm = hfpatch.apply.unwrap(self.model)
        chunk = auto_chunk(ids.shape[0], ids.shape[1], lm.config.get_text_config().vocab_size, self.chunk)
        hidden = lm.base_model(input_ids=ids, use_cache=False).last_hidden_state
        labels = shift(ids)
        teacher_hidden = teacher_head = None
        if self.teacher is not None:
            with torch.no_grad():
                teacher_hidden = self.teacher.base_model(input_ids=ids, use_cache=False).last_hidden_state
            teacher_head = output_head(self.teacher)
        return chunked_lm_loss(hidden, labels, output_head(lm), chunk, teacher_hidden, teacher_head,
                               self.temperature, self.alpha if self.teacher is not None else 0.0)


class Progress:
    """The step reached and the tokens seen (saved in the checkpoint marker, with the scheduler's state)."""

    def __init__(self):
        self.step, self.tokens = 0, 0

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state):
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


def train(cfg, model, tok, train_seqs, eval_seqs, teacher=None) -> dict:
    # cpu=True where there is no GPU: processes started by torchrun (accelerate's multi-process launcher) then
    # form a gloo group on the CPU instead of failing to find devices
    accelerator = Accelerator(mixed_precision=cfg.precision, log_with=cfg.log_with, project_dir=cfg.output_dir,
                              cpu=not torch.cuda.is_available())
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    if cfg.gradient_checkpointing:
        # every block is recomputed in the backward pass (patched blocks included: they swap classes, not forwards)
        hfpatch.apply.unwrap(model).activation_checkpointing_enable({"use_reentrant": False})
    if cfg.lora.enabled:
        import peft

        targets = cfg.lora.target_modules
        try:
            model = peft.get_peft_model(model, peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                               lora_dropout=cfg.lora.dropout, target_modules=targets))
        except ValueError as e:  # e.g. target modules the model does not have
            raise ConfigError(f"lora: {' '.join(str(e).split())}") from None
    distill = getattr(cfg, "distill", None)
    loss_module = CausalLMLoss(model, chunk=cfg.loss_chunk, teacher=teacher,
                               alpha=distill.alpha if distill else 0.0,
                               temperature=distill.temperature if distill else 1.0)
    params = [p for p in loss_module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
    loss_module, optimizer = accelerator.prepare(loss_module, optimizer)
    progress = Progress()
    states = {"progress": progress, "scheduler": scheduler}  # saved as JSON in the checkpoint marker
    if teacher is not None:
        teacher.to(accelerator.device).eval().requires_grad_(False)

    log = out / "log.jsonl"
    if cfg.resume:
        checkpoint.resume(accelerator, cfg.resume, out, states, log)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        accelerator.init_trackers("hfpatch", config={k: v for k, v in cfg.items() if not isinstance(v, dict)})

    rank, world, bs = accelerator.process_index, accelerator.num_processes, cfg.batch_size
    tokens_per_step = bs * world * cfg.grad_accum * cfg.seq_len
    bar = tqdm(total=cfg.max_steps, initial=progress.step, disable=not accelerator.is_main_process, desc="train")
    t_start, last = time.perf_counter(), {}
    while progress.step < cfg.max_steps:
        step = progress.step
        loss_module.train()
        totals = torch.zeros(3, device=accelerator.device)
        for a in range(cfg.grad_accum):
            idx = batch_indices(len(train_seqs), bs * world, step * cfg.grad_accum + a, cfg.seed)[rank * bs:(rank + 1) * bs]
            ids = train_seqs[idx].to(accelerator.device)
            sync = a == cfg.grad_accum - 1
            ctx = accelerator.no_sync(loss_module) if not sync else _null()
            with ctx:
                loss, ce, kl = loss_module(ids)
                accelerator.backward(loss / cfg.grad_accum)
            totals += torch.stack([loss.detach(), ce.detach(), kl.detach()]).float() / cfg.grad_accum
        if cfg.clip:
            accelerator.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step, progress.tokens = step + 1, progress.tokens + tokens_per_step
        totals = accelerator.reduce(totals, reduction="mean")
        elapsed = time.perf_counter() - t_start
        last = {"step": progress.step, "loss": totals[0].item(), "ce": totals[1].item(), "kl": totals[2].item(),
                "lr": scheduler.get_last_lr()[0], "tokens": progress.tokens, "seconds": round(elapsed, 3)}
        if progress.step % cfg.eval_every == 0 or progress.step == cfg.max_steps:
            last["eval_loss"] = evaluate(cfg, loss_module, eval_seqs, accelerator)
        if accelerator.is_main_process:
            with log.open("a") as f:
                f.write(json.dumps(last) + "\n")
            accelerator.log(last, step=progress.step)
            bar.set_postfix(loss=f"{last['loss']:.4f}")
            bar.update(1)
        if progress.step % cfg.save_every == 0 or progress.step == cfg.max_steps:
            checkpoint.save(accelerator, out / "checkpoints", progress.step, states)
        if cfg.stop_after is not None and progress.step >= cfg.stop_after:
            break
    bar.close()
    accelerator.wait_for_everyone()
    final = None
    if progress.step >= cfg.max_steps:
        final = save_final(cfg, accelerator, loss_module, tok, out / "final")
    accelerator.end_training()
    return {"step": progress.step, "last": last, "final": str(final) if final else None}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def evaluate(cfg, loss_module, eval_seqs, accelerator) -> float | None:
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


def save_final(cfg, accelerator, loss_module, tok, path: Path):
    state = accelerator.get_state_dict(loss_module)  # gathered in full under FSDP / ZeRO-3
    if not accelerator.is_main_process:
        return None
    model = accelerator.unwrap_model(loss_module).model
    if hasattr(model, "merge_and_unload"):  # LoRA: fold the adapters into the weights
        model = model.merge_and_unload()
        state = None
    else:
        state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    tmp = path.with_name(path.name + ".partial")  # renamed to `path` once complete
    shutil.rmtree(tmp, ignore_errors=True)
    hfpatch.save_pretrained(model, tmp, tokenizer=tok, **({"state_dict": state} if state is not None else {}))
    checkpoint.publish(tmp, path)
    return path
