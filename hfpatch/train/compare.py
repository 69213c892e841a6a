"""What recipes/compare.py is made of: the study config, one pretraining run per (arm, seed) on the pretrain
machinery, the measurements a study asks for, and the study's JSON, table and plot.

A study trains N small models that differ in one axis only: every arm is the same `pretrain` config (model, data,
tokenizer, steps, seed) with a few overrides (the axis: a patch, a depth, the warm-up). Each run is exactly
`recipes/pretrain.py` with those overrides (the JSON records the equivalent command), trained in this process so
that its gradients can be recorded. Runs already finished are kept (their folder has `final`), an interrupted one
resumes from its newest checkpoint, the evaluations resume from their results files: a killed study loses nothing.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch.optim.optimizer import register_optimizer_step_pre_hook

import hfpatch

from ..adapters import adapter_for
from ..evaluate.report import markdown_table
from ..norm.batchnorm import batch_statistics
from ..text import documents, tokenize
from .config import ConfigError
from .config import load as load_config

# ------------------------------------------------------------------------------------------------------ config

REQUIRED = object()
# key: (types, default)
STUDY = {
    "study": (str, REQUIRED),  # the study's name: output_dir/compare_<study>.{json,md,png}
    "pretrain": (dict, REQUIRED),  # a recipes/pretrain.py config shared by every arm
    "arms": (dict, REQUIRED),  # arm name -> overrides of `pretrain` (dotted keys allowed): the one axis that differs
    "seeds": (list, [0]),  # every arm runs once per seed (init and data order)
    "tokenizer_vocab": (int, 2048),  # vocabulary of the BPE trained on the training text if the tokenizer is absent
    "output_dir": (str, "runs/compare"),
    "evaluate": (dict, {}),
}
EVALUATE = {
    "text_files": ((list, type(None)), None),  # held-out text (not trained on); None: no text evaluations
    "tokens_per_doc": (int, 16384),  # tokens of it scored at every length
    "lengths": ((list, type(None)), None),  # perplexity at these lengths (chunks); None: seq_len only
    "passkey": ((dict, type(None)), None),  # {arms: [...], lengths: [...], depths: [...], trials: n}
    "recall": ((dict, type(None)), None),  # {distances: [...], span: 32, trials: 16}: the repeated-span probe
    "batch_statistics": (bool, False),  # batch norms: running statistics at batch 1 vs the batch's own
    "grad_norms": (bool, False),  # record per-layer gradient norms every step
    "step_time_rounds": (int, 0),  # > 0: time a training step of every arm side by side, this many rounds
}


def _check(schema: dict, values: dict, where: str) -> dict:
    out = {}
    for key, value in values.items():
        if key not in schema:
            raise ConfigError(f"unknown key {where}{key!r}; valid: {', '.join(sorted(schema))}")
    for key, (types, default) in schema.items():
        if key not in values:
            if default is REQUIRED:
                raise ConfigError(f"{where}{key} is required")
            out[key] = copy.deepcopy(default)
            continue
        value = values[key]
        allowed = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"{where}{key} must be {names}, got {value!r}")
        out[key] = value
    return out


def _flatten(overrides: dict, prefix: str = "") -> list[str]:
    """{a: {b: 1}} -> ["a.b=1"] (sections the pretrain schema merges key by key); patch and model_config values that
    are whole dicts stay whole (the pretrain config replaces them as a whole)."""
    out = []
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in ("patch", "model_config") and value:
            out += _flatten(value, name + ".")
        else:
            out.append(f"{name}={yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()}")
            out[-1] = out[-1].removesuffix("\n...").removesuffix(" ...")
    return out


def load_study(path: str | None, overrides: list[str]) -> dict:
    """The study config (YAML + key=value overrides with dotted keys, e.g. pretrain.max_steps=20), checked."""
    values = {}
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"config file not found: {path}")
        values = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        *parents, last = key.strip().split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[last] = yaml.safe_load(raw) if raw.strip() else None
    study = _check(STUDY, values, "")
    study["evaluate"] = _check(EVALUATE, study["evaluate"], "evaluate.")
    if not study["arms"]:
        raise ConfigError("arms must name at least one arm")
    if not study["seeds"] or not all(isinstance(s, int) and not isinstance(s, bool) for s in study["seeds"]):
        raise ConfigError(f"seeds must be a non-empty list of integers, got {study['seeds']!r}")
    for name, arm in study["arms"].items():
        if not isinstance(arm, dict):
            raise ConfigError(f"arms.{name} must be a mapping of pretrain overrides, got {arm!r}")
    ev = study["evaluate"]
    if ev["text_files"] is not None:
        for f in ev["text_files"]:
            if not Path(f).exists():
                raise ConfigError(f"evaluate.text_files: not found: {f}")
    for key in ("passkey", "recall"):
        if ev[key] is not None:
            unknown = sorted(set(ev[key].get("arms", [])) - set(study["arms"]))
            if unknown:
                raise ConfigError(f"evaluate.{key}.arms names unknown arms {unknown}; arms: {', '.join(study['arms'])}")
    return study


@dataclass
class Run:
    arm: str
    seed: int
    out: Path
    overrides: list  # the pretrain overrides that make this run
    cfg: dict  # the checked pretrain config

    @property
    def name(self) -> str:
        return self.arm if self.out.name == self.arm else f"{self.arm}/{self.out.name}"

    @property
    def command(self) -> str:
        return "accelerate launch recipes/pretrain.py " + " ".join(f"'{o}'" for o in self.overrides)


def claim(run: Run) -> None:
    """A run folder remembers the settings it was trained with: reusing it for other ones is refused (a study whose
    config changed would otherwise keep old runs as if they were the new ones)."""
    marker = run.out / "compare_run.json"
    if marker.exists():
        had = json.loads(marker.read_text())["overrides"]
        if had != run.overrides:
            changed = sorted(set(had) ^ set(run.overrides))
            raise ConfigError(f"{run.out} holds a run made with other settings ({', '.join(changed)}); use another "
                              "output_dir, or delete that folder to train it again")
        return
    run.out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"arm": run.arm, "seed": run.seed, "overrides": run.overrides}, indent=1) + "\n")


def plan(study: dict) -> list[Run]:
    """Every (arm, seed) as a checked pretrain config: a bad arm fails now, before anything trains."""
    runs = []
    base = _flatten(study["pretrain"])
    several = len(study["seeds"]) > 1
    for arm, extra in study["arms"].items():
        for seed in study["seeds"]:
            out = Path(study["output_dir"]) / arm
            out = out / f"seed{seed}" if several else out
            overrides = base + _flatten(extra) + [f"seed={seed}", f"output_dir={out}"]
            try:
                # a study started again continues its runs: their folders may hold one (train() resumes it)
                cfg = load_config("pretrain", None, overrides + ["resume=true"])
            except ConfigError as e:
                raise ConfigError(f"arm {arm!r}: {e}") from None
            runs.append(Run(arm, seed, out, overrides, cfg))
    return runs


# ------------------------------------------------------------------------------------------------ gradient norms

class GradNorms:
    """The gradient norm of each block (and of the embeddings / the final norm and head) at every optimizer step,
    before clipping: each parameter's gradient is read when backward has accumulated it (post-accumulate hooks), and
    the step's row is written when an optimizer steps (torch's global optimizer hook). Rows go to a JSON-lines file
    as they come; a resumed run continues it (the last row of a step wins)."""

    def __init__(self, model, path: Path, first_step: int):
        target = hfpatch.apply.unwrap(model)
        prefix = "" if target.base_model is target else target.base_model_prefix + "."
        layers = prefix + adapter_for(target).layers + "."
        self.path, self.step, self.sq = path, first_step, {}
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

    def _reader(self, group, key):
        def read(p):
            self.sq[key] = (group, float(p.grad.detach().float().pow(2).sum()))  # latest = the accumulated gradient
        return read

    def _flush(self, optimizer, args, kwargs):
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


def _group_order(item):
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


def newest_checkpoint_step(out: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*")]
    return max(steps, default=0)


# -------------------------------------------------------------------------------------------------- measurements

def held_out_tokens(study: dict, tok) -> torch.Tensor:
    """The first tokens_per_doc tokens of the evaluation text (its first document that long)."""
    ev = study["evaluate"]
    for doc in documents(ev["text_files"]):
        ids = tokenize(tok, doc).ids
        if len(ids) >= ev["tokens_per_doc"]:
            return torch.as_tensor(ids[: ev["tokens_per_doc"]].copy())
    raise ConfigError(f"evaluate.text_files: no document has tokens_per_doc={ev['tokens_per_doc']} tokens")


@torch.no_grad()
def mean_nll(model, seqs: torch.Tensor, batch: int) -> float:
    """Mean -log p of every token after the first of each sequence, `batch` sequences per forward."""
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch):
        x = seqs[i:i + batch]
        logits = model(input_ids=x, use_cache=False).logits.float()
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
        count += x[:, 1:].numel()
    return total / count


def statistics_effect(model, ids: torch.Tensor, seq_len: int, batch: int) -> dict:
    """Held-out NLL of chunks of seq_len: the model in eval() (a batch norm uses its running statistics) at batch
    1 and at the training batch, and with every batch norm using the statistics of the batch it is given
    (batch_statistics) at those sizes. For a model without batch norms all four agree."""
    seqs = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    seqs = seqs[: len(seqs) // batch * batch]  # every batch full, so the four see the same tokens
    model.eval()
    out = {"running_batch1": mean_nll(model, seqs, 1), f"running_batch{batch}": mean_nll(model, seqs, batch)}
    with batch_statistics(model):
        out["batchstats_batch1"] = mean_nll(model, seqs, 1)
        out[f"batchstats_batch{batch}"] = mean_nll(model, seqs, batch)
    return {"sequences": len(seqs), "seq_len": seq_len, "nll": out}


@torch.no_grad()
def recall(model, ids: torch.Tensor, distances: list[int], span: int = 32, trials: int = 16, seed: int = 0,
           limit: int | None = None) -> dict:
    """Can the model use what it read `distance` tokens ago? Span A (held-out text) appears, then `distance` tokens
    of other held-out text, then A again; the control has another span B in A's first place. The gain is the NLL of
    the second A (its tokens after the first) in the control minus in the copy: ~0 when nothing is recalled from
    that far, up to the control NLL when the copy is perfect. Distances whose sequence passes `limit` are skipped."""
    g = torch.Generator().manual_seed(seed)
    out = {}
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
        nll = {}
        for name, seqs in (("copy", torch.stack(copy_seqs)), ("control", torch.stack(control_seqs))):
            total_nll = 0.0
            for i in range(0, trials, 4):
                x = seqs[i:i + 4]
                logits = model(input_ids=x, use_cache=False).logits[:, -span:-1].float()
                total_nll += float(F.cross_entropy(logits.flatten(0, 1), x[:, -span + 1:].flatten(), reduction="sum"))
            nll[name] = total_nll / (trials * (span - 1))
        out[str(d)] = {"copy_nll": nll["copy"], "control_nll": nll["control"], "gain": nll["control"] - nll["copy"]}
    return out


def step_times(models: dict, batch: torch.Tensor, rounds: int) -> dict:
    """Seconds of a training step's forward and backward per model, measured side by side: each round times every
    model once, in turn, so a machine that gets busier slows them alike; the median over `rounds` (after one
    round of warm-up)."""
    times = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, model in models.items():
            model.train()
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def training_summary(out: Path) -> dict:
    """From the run's log: loss curve, held-out losses, seconds per step, divergence."""
    rows = read_jsonl(out / "log.jsonl")
    if not rows:
        return {}
    losses = [r["loss"] for r in rows]
    seconds = [r["seconds"] for r in rows]
    deltas = [b - a for a, b in zip(seconds, seconds[1:]) if b > a]  # a resumed run restarts its clock
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


# ---------------------------------------------------------------------------------------------------- reporting

def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


def _f(x, digits=2):
    return "—" if x is None else (f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.3g}")


def table(summary: dict) -> str:
    """Markdown tables of a study summary: per arm (means over seeds)."""

    runs = summary["runs"]
    arms = [a for a in summary["arms"] if any(r["arm"] == a for r in runs)]  # the arms done so far
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    parts = []
    lengths = summary.get("lengths") or []
    header = ["arm", "params", "final train loss", "held-out loss", "s/step"] + [f"ppl {n}" for n in lengths]
    if summary.get("seeds", [0])[1:]:
        header.insert(1, "seeds")
    rows = []
    for a in arms:
        rs = by_arm[a]
        ev = [list(r["training"].get("eval_loss", {}).values())[-1] for r in rs if r["training"].get("eval_loss")]
        row = [a, f"{rs[0].get('parameters', 0) / 1e6:.2f} M", _f(_mean(r["training"].get("final_loss") for r in rs), 3),
               _f(_mean(ev), 3), _f(_mean(r["training"].get("seconds_per_step") for r in rs), 3)]
        row += [_f(_mean(r.get("ppl", {}).get(str(n)) for r in rs)) for n in lengths]
        if summary.get("seeds", [0])[1:]:
            row.insert(1, str(len(rs)))
        rows.append(row)
    parts.append("**per arm** (held-out loss: the run's own eval split; ppl: the evaluation text, chunks of each "
                 "length; means over seeds)\n\n" + markdown_table(header, rows))
    if summary.get("step_time"):
        st = summary["step_time"]
        first = next(iter(st["seconds"].values()))
        rows = [[a, f"{t:.3f}", f"{t / first:.3f}"] for a, t in st["seconds"].items()]
        parts.append(f"**training step, side by side** (forward + backward of a [{st['batch']}] batch, median of "
                     f"{st['rounds']} rounds, arms in turn)\n\n" + markdown_table(["arm", "seconds", "ratio"], rows))
    if any("statistics" in r for r in runs):
        keys = list(next(r for r in runs if "statistics" in r)["statistics"]["nll"])
        rows = [[a] + [_f(_mean(r["statistics"]["nll"][k] for r in by_arm[a] if "statistics" in r), 4) for k in keys]
                for a in arms]
        parts.append("**held-out NLL by normalisation statistics** (eval(): running; batchstats: the batch's own)\n\n"
                     + markdown_table(["arm"] + keys, rows))
    if any("recall" in r for r in runs):
        ds = list(next(r for r in runs if "recall" in r)["recall"])
        rows = [[a] + [_f(_mean(r["recall"][d].get("gain") for r in by_arm[a] if "recall" in r), 3) for d in ds]
                for a in arms if any("recall" in r for r in by_arm[a])]
        parts.append("**recall gain** (nats/token: NLL of a repeated span without minus with its first copy, by "
                     "distance)\n\n" + markdown_table(["arm"] + [f"d={d}" for d in ds], rows))
    if any("passkey" in r for r in runs):
        rows = []
        for r in runs:
            for n, acc in r.get("passkey", {}).items():
                rows.append([r["name"], n, _f(acc, 2)])
        parts.append("**passkey accuracy** (all depths)\n\n" + markdown_table(["run", "length", "accuracy"], rows))
    if any("grad_norms" in r for r in runs):
        rows = []
        for a in arms:
            rs = by_arm[a]
            init = [r["grad_norms"]["init"] for r in rs if r.get("grad_norms")]
            first = _mean(i.get("layer.0") for i in init)
            last_key = max((k for i in init for k in i if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]),
                           default=None)
            last = _mean(i.get(last_key) for i in init) if last_key else None
            rows.append([a, f"{sum(r['training'].get('diverged', False) for r in rs)}/{len(rs)}",
                         _f(_mean(r["training"].get("final_loss") for r in rs), 3), _f(first, 3), _f(last, 3),
                         _f(None if not first or not last else last / first, 2)])
        parts.append("**placement** (gradient norms at the first step, before clipping; diverged: loss not finite or "
                     "ending 0.5 nats above its best)\n\n" + markdown_table(
                         ["arm", "diverged", "final loss", "grad first block", "grad last block", "last / first"],
                         rows))
    return "\n\n".join(parts)


def plot(summary: dict, path: Path) -> None:
    """One figure per study, a panel per measurement present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, arms = summary["runs"], list(summary["arms"])
    panels = ["loss"]
    if summary.get("lengths"):
        panels.append("ppl")
    if any("recall" in r for r in runs):
        panels.append("recall")
    if any("grad_norms" in r for r in runs):
        panels += ["grad_init", "grad_train"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    colors = {a: c for a, c in zip(arms, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)}
    for ax, panel in zip(axes[0], panels):
        for a in arms:
            for k, r in enumerate(x for x in runs if x["arm"] == a):
                label = a if k == 0 else None
                if panel == "loss" and r["training"].get("loss"):
                    y = r["training"]["loss"]
                    ax.plot(range(1, len(y) + 1), y, color=colors[a], lw=0.8, alpha=0.8, label=label)
                elif panel == "ppl":
                    pts = [(int(n), v) for n, v in r.get("ppl", {}).items() if v]
                    if pts:
                        ax.plot(*zip(*sorted(pts)), marker="o", color=colors[a], label=label)
                elif panel == "recall" and "recall" in r:
                    pts = [(int(d), v["gain"]) for d, v in r["recall"].items() if "gain" in v]
                    if pts:
                        ax.plot(*zip(*sorted(pts)), marker="o", color=colors[a], label=label)
                elif panel == "grad_init" and r.get("grad_norms"):
                    init = r["grad_norms"]["init"]
                    layers = sorted((k for k in init if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]))
                    ax.plot(range(len(layers)), [init[k] for k in layers], marker=".", color=colors[a], label=label)
                elif panel == "grad_train" and r.get("grad_norms"):
                    rows = r["grad_norms"]["steps"]
                    ax.plot([x["step"] for x in rows], [x["total"] for x in rows], color=colors[a], lw=0.8,
                            label=label)
        titles = {"loss": ("training loss", "step", "loss"), "ppl": ("held-out perplexity", "length", "perplexity"),
                  "recall": ("recall gain of a repeated span", "distance (tokens)", "nats / token"),
                  "grad_init": ("gradient norm per block, step 1", "block", "norm (before clipping)"),
                  "grad_train": ("total gradient norm", "step", "norm (before clipping)")}
        title, xl, yl = titles[panel]
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        if panel in ("ppl", "grad_init", "grad_train"):
            ax.set_yscale("log")
        if panel in ("ppl", "recall"):
            ax.set_xscale("log", base=2)
            if summary.get("trained_length"):
                ax.axvline(summary["trained_length"], color="gray", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"compare: {summary['study']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_safe(x):
    """JSON has no NaN or infinity: they are written as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write(summary: dict, out: Path, plot_it: bool = True) -> Path:
    """compare_<study>.json (atomically), .md and .png under `out`; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"compare_{summary['study']}"
    tmp = stem.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_json_safe(summary), indent=1) + "\n")
    os.replace(tmp, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(table(summary) + "\n")
    if plot_it:
        plot(summary, stem.with_suffix(".png"))
    return stem.with_suffix(".json")
