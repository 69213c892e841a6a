"""Checkpoints that a kill at any moment cannot corrupt, the resume that picks the newest complete one, and the final
save that is never left half-written under its real name.

Layout of output_dir:
    checkpoints/step_N/            complete: accelerate's save_state files + hfpatch_checkpoint.json
    checkpoints/step_N.partial/    being written, or left by a killed run: never read, removed on the next save
    final/                         hfpatch.save_pretrained of the trained model (written as final.partial/)
    log.jsonl                      one row per step; a resume cuts it back to the checkpoint's step

Why a marker and a rename: accelerate's save_state writes its files one by one into the folder it is given, so a
kill leaves a folder that looks like a checkpoint (an empty step_N/ was taken for the newest one and the resume died
on the missing weights). Here a folder only gets its step_N name by one rename, after every file, the marker
included, is written and fsync'ed. The marker lists every file with its size; they are checked again before a resume
(a folder damaged later, or written by an hfpatch without markers, is skipped and the reason printed).

What is a pickle: the model weights are safetensors (save_state(safe_serialization=True)). The optimizer state
(optimizer.bin) and the RNG states (random_states_<rank>.pkl) are torch.save files, that is pickles, written by
accelerate; accelerate reads them back with torch.load(weights_only=True), whose unpickler rebuilds tensors and plain
containers (plus numpy arrays, which accelerate allows) and refuses anything else, so loading one runs no code. The
loop's own state (step, tokens, the LR scheduler) goes into the JSON marker rather than accelerate's custom-object
files, which accelerate loads with weights_only=False.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

from accelerate.utils import load as load_pickle  # torch.load(weights_only=True) + numpy arrays

from .config import ConfigError

MARKER = "hfpatch_checkpoint.json"
FORMAT = 1
_STEP = re.compile(r"step_(\d+)")
_PARTIAL = ".partial"  # suffix of a folder being written (or being deleted)


def save(accelerator, root: Path, step: int, states: dict) -> Path:
    """accelerator.save_state for `step` under root/step_<step>; `states`: objects with a JSON-able state_dict()
    and load_state_dict() (the step counter, the LR scheduler), kept in the marker. Every process must call this."""
    path = root / f"step_{step}"
    tmp = path.with_name(path.name + _PARTIAL)
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()  # every process has written its part (its RNG state, its shards)
    if accelerator.is_main_process:
        marker = {"format": FORMAT, "step": step, "processes": accelerator.num_processes,
                  "states": {name: obj.state_dict() for name, obj in states.items()}, "files": _sizes(tmp)}
        write_json(tmp / MARKER, marker)
        publish(tmp, path)
    accelerator.wait_for_everyone()
    return path


def problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None if it is one."""
    marker = path / MARKER
    if not path.is_dir():
        return "not a folder"
    if not marker.is_file():
        return f"no {MARKER} (interrupted while being written, or saved by an older hfpatch)"
    try:
        info = json.loads(marker.read_text())
        files, step = info["files"], int(info["step"])
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MARKER} ({e})"
    if info.get("format") != FORMAT:
        return f"{MARKER} of format {info.get('format')!r}, this hfpatch reads format {FORMAT}"
    named = _STEP.fullmatch(path.name)
    if named and int(named.group(1)) != step:
        return f"the folder is named {path.name} but holds step {step}"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the marker says {size}"
    return None


def newest_complete(root: Path) -> tuple[Path | None, list[str]]:
    """(the complete checkpoint of the highest step under root, or None; why each newer folder was skipped)."""
    found = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := _STEP.fullmatch(p.name)))
    skipped = []
    for _, path in reversed(found):
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append(f"{path.name}: {why}")
    return None, skipped


def resume(accelerator, resume, out: Path, states: dict, log: Path) -> int:
    """Load what the run resumes from and return its step: the checkpoint folder `resume` names, or with
    resume=True the newest complete one under out/checkpoints (0 and a fresh start, said on stdout, when there is
    none). log.jsonl is cut back to the rows of the steps up to it, so the resumed run writes the rest once."""
    if isinstance(resume, str):
        path = Path(resume)
        why = problem(path)
        if why is not None:
            raise ConfigError(f"resume: {path} is not a complete checkpoint: {why}")
        skipped = []
    else:
        path, skipped = newest_complete(out / "checkpoints")
    for line in skipped:
        accelerator.print(f"resume: skipped {line}")
    step = 0
    if path is None:
        accelerator.print(f"resume: no complete checkpoint in {out / 'checkpoints'}; starting from step 0")
    else:
        info = json.loads((path / MARKER).read_text())
        try:
            for rng in sorted(path.glob("random_states_*.pkl")):  # accelerate would skip an unreadable one silently
                load_pickle(rng)
            accelerator.load_state(str(path))
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused an object: nothing was run
            raise ConfigError(f"resume: {path} holds a pickle that is not plain tensors and containers, refused "
                              f"unread: {' '.join(str(e).split())[:300]}") from None
        for name, obj in states.items():
            obj.load_state_dict(info["states"][name])
        step = int(info["step"])
        if info["processes"] != accelerator.num_processes:
            accelerator.print(f"resume: note: {path} was written by {info['processes']} processes, this run has "
                              f"{accelerator.num_processes}: the batches (and the loss curve) differ from there on")
        accelerator.print(f"resumed from {path} at step {step}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        cut_log(log, step)
        for stale in (out / "checkpoints").glob("*" + _PARTIAL):  # folders a killed run was writing
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return step


def cut_log(log: Path, step: int) -> None:
    """Keep the rows of steps <= `step` (stopping at a line a kill left half-written), atomically."""
    if not log.is_file():
        return
    kept = []
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict) or row.get("step", step + 1) > step:
            break
        kept.append(line + "\n")
    tmp = log.with_name(log.name + _PARTIAL)
    tmp.write_text("".join(kept))
    _fsync(tmp)
    os.replace(tmp, log)


def publish(tmp: Path, path: Path) -> None:
    """Give the finished folder `tmp` its name `path` in one rename, after its files reached the disk. A folder
    already at `path` (a step saved again after resuming from an older one, or a new final model) is first renamed
    out of the way and deleted, so `path` is at every instant either the old complete folder, absent, or the new one.
    """
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(tmp)
    if path.exists():
        trash = path.with_name(path.name + ".old" + _PARTIAL)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash)
    os.rename(tmp, path)
    _fsync(path.parent)


def write_json(path: Path, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _sizes(folder: Path) -> dict[str, int]:
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
