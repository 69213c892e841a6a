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
included, is written and fsync'ed. The marker lists every file with its size and SHA-256; before a resume they are
checked again, so is the marker's own content against the SHA-256 it carries (SEAL: an edited LR schedule would
otherwise resume at, say, 5000x the learning rate), and the marker's step, progress and LR schedule must agree. A
folder damaged later (a bit flipped, a file zeroed or added, the marker edited), or written by an hfpatch without
such markers, is skipped with the reason printed, and the resume goes on from the newest checkpoint that passes.

The marker also holds the run's identity (loop.run_identity: the settings that decide the training, a hash of its
data, the model's files): a resume with another identity is refused with what differs, never continued as if it
were the same run.

What is a pickle: the model weights are safetensors (save_state(safe_serialization=True)). The optimizer state
(optimizer.bin) and the RNG states (random_states_<rank>.pkl) are torch.save files, that is pickles, written by
accelerate; accelerate reads them back with torch.load(weights_only=True), whose unpickler rebuilds tensors and plain
containers (plus numpy arrays, which accelerate allows) and refuses anything else, so loading one runs no code. The
loop's own state (step, tokens, the LR scheduler) goes into the JSON marker rather than accelerate's custom-object
files, which accelerate loads with weights_only=False.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list
from accelerate.utils import load as load_pickle  # torch.load(weights_only=True) + numpy arrays

from ..utils.files import PARTIAL as _PARTIAL  # suffix of a folder being written (or being deleted)
from ..utils.files import differences, os_error_of, publish, sha256_many, write_file, write_json
from .config import ConfigError

MARKER = "hfpatch_checkpoint.json"
FORMAT = 3  # 2: every file's SHA-256, the run's identity; 3: the marker's own SHA-256 (SEAL)
SEAL = "marker_sha256"
_STEP = re.compile(r"step_(\d+)")


def save(accelerator, root: Path, step: int, states: dict, identity: dict | None = None) -> Path:
    """accelerator.save_state for `step` under root/step_<step>; `states`: objects with a JSON-able state_dict()
    and load_state_dict() (the step counter, the LR scheduler), kept in the marker with the run's `identity`. Every
    process must call this. A write that fails (a full disk: an OSError naming step_<step>, whichever of torch and
    safetensors hit it) or is interrupted leaves no step_<step>.partial behind."""
    path = root / f"step_{step}"
    tmp = path.with_name(path.name + _PARTIAL)
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()  # every process has written its part (its RNG state, its shards)
        if accelerator.is_main_process:
            marker = {"format": FORMAT, "step": step, "processes": accelerator.num_processes, "run": identity,
                      "states": {name: obj.state_dict() for name, obj in states.items()}, "files": _contents(tmp)}
            write_json(tmp / MARKER, seal(marker))
            publish(tmp, path)
    except BaseException as e:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        failed = os_error_of(e)
        if failed is None:
            raise
        raise OSError(failed.errno, failed.strerror, str(path)) from None
    accelerator.wait_for_everyone()
    return path


def seal(marker: dict) -> dict:
    """The marker with the SHA-256 of its own content (every key but that one, as JSON with sorted keys), so that
    an edit of any of it (the LR schedule's base rates, the step, the run's identity) is found on resume."""
    plain = json.loads(json.dumps({k: v for k, v in marker.items() if k != SEAL}))  # as the file will hold it
    return {**plain, SEAL: _digest(plain)}


def _digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None if it is one: its marker is readable and of this format,
    names its step, and lists exactly the files in the folder, each with the size and SHA-256 it has."""
    marker = path / MARKER
    if not path.is_dir():
        return "not a folder"
    if not marker.is_file():
        return f"no {MARKER} (interrupted while being written, or saved by an older hfpatch)"
    try:
        info = json.loads(marker.read_text())
        files, step = info["files"], int(info["step"])
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise TypeError("files is not a table of files")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MARKER} ({type(e).__name__}: {e})"
    if info.get("format") != FORMAT:
        return f"{MARKER} of format {info.get('format')!r}, this hfpatch reads format {FORMAT}"
    if not isinstance(info.get("states"), dict):
        return f"its {MARKER} has no states (the step counter and the LR schedule)"
    named = _STEP.fullmatch(path.name)
    if named and int(named.group(1)) != step:
        return f"the folder is named {path.name} but holds step {step}"
    present = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()} - {MARKER}
    extra = sorted(present - set(files))
    if extra:
        return f"{extra[0]} is not listed in its {MARKER}"
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry.get("bytes"):
            return f"{name} has {f.stat().st_size} bytes, the marker says {entry.get('bytes')}"
    names = sorted(files)
    for name, digest in zip(names, sha256_many([path / n for n in names])):
        if digest != files[name].get("sha256"):
            return f"{name}: its content is not what was saved (its SHA-256 differs from the marker's)"
    if info.get(SEAL) != _digest({k: v for k, v in info.items() if k != SEAL}):
        return (f"its {MARKER} was edited after it was saved (its content's SHA-256 differs from its {SEAL}): its "
                "step, LR schedule or run settings are not the ones saved with these files")
    return None


def step_of(path: Path) -> int:
    """The step a complete checkpoint (problem(path) is None) holds, from its marker."""
    return int(json.loads((path / MARKER).read_text())["step"])


def states_problem(info: dict, states: dict) -> str | None:
    """Why the marker's states cannot be loaded into `states` (None if they can)."""
    for name in states:
        if not isinstance(info["states"].get(name), dict):
            return f"its {MARKER} has no state for {name}"
    return None


def newest_complete(root: Path, check=None) -> tuple[Path | None, list[str]]:
    """(the complete checkpoint of the highest step under root, or None; why each newer folder was skipped).
    `check(info)`: a further reason to skip a checkpoint whose files are complete (None: none)."""
    found = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := _STEP.fullmatch(p.name)))
    skipped: list[str] = []
    for _, path in reversed(found):
        why = problem(path)
        if why is None and check is not None:
            why = check(json.loads((path / MARKER).read_text()))
        if why is None:
            return path, skipped
        skipped.append(f"{path.name}: {why}")
    return None, skipped


def resume(accelerator, resume, out: Path, states: dict, log: Path, identity: dict | None = None, consistent=None,
           loaded=None) -> int:
    """Load what the run resumes from and return its step: the checkpoint folder `resume` names, or with
    resume=True the newest complete one under out/checkpoints (0 and a fresh start, said on stdout, when there is
    none). log.jsonl is cut back to the rows of the steps up to it, so the resumed run writes the rest once.

    `identity`: the run's, refused (ConfigError, listing what differs) when the checkpoint's is another.
    `consistent(info)`: why the marker's states disagree with its step (a checkpoint skipped for it).
    `loaded(step)`: after loading, why the loaded files disagree with the step (refused: the weights are no longer
    the ones a fresh start would have)."""
    def check(info) -> str | None:
        return states_problem(info, states) or (consistent(info) if consistent else None)

    path = _choose_checkpoint(accelerator, resume, out, check)
    step = 0
    if path is None:
        accelerator.print(f"resume: no complete checkpoint in {out / 'checkpoints'}; starting from step 0")
    else:
        step = _load_checkpoint(accelerator, path, states, identity, loaded)
        accelerator.print(f"resumed from {path} at step {step}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        cut_log(log, step)
        for stale in (out / "checkpoints").glob("*" + _PARTIAL):  # folders a killed run was writing
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return step


def _choose_checkpoint(accelerator: Any, resume: str | bool, out: Path,
                       check: Callable[[dict], str | None]) -> Path | None:
    """The checkpoint to resume from: the folder `resume` names (refused with ConfigError if it is not complete), or
    the newest complete one under out/checkpoints (None: there is none), the skipped ones said on stdout."""
    # the main process checks the files (hashing them once) and tells the others what it chose
    choice: list[Any] = [None, [], None]  # (why refused, skipped folders, the chosen one)
    if accelerator.is_main_process:
        if isinstance(resume, str):
            given = Path(resume)
            why = problem(given)
            why = why or check(json.loads((given / MARKER).read_text()))
            choice = [why and f"resume: {given} is not a complete checkpoint: {why}", [], str(given)]
        else:
            newest, skipped = newest_complete(out / "checkpoints", check)
            choice = [None, skipped, str(newest) if newest else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(choice)
    refused, skipped, chosen = choice
    if refused:
        raise ConfigError(refused)
    for line in skipped:
        accelerator.print(f"resume: skipped {line}")
    return Path(chosen) if chosen else None


def _load_checkpoint(accelerator: Any, path: Path, states: dict, identity: dict | None,
                     loaded: Callable[[int], str | None] | None) -> int:
    """Load the complete checkpoint `path` into the run and `states`; its step. A checkpoint of another run, one
    that does not load, or one whose files disagree with its step is refused with ConfigError."""
    info = json.loads((path / MARKER).read_text())
    if identity is not None:
        _check_identity(path, info.get("run"), identity)
    try:
        for rng in sorted(path.glob("random_states_*.pkl")):  # accelerate would skip an unreadable one silently
            load_pickle(rng)
        accelerator.load_state(str(path))
    except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused an object: nothing was run
        raise ConfigError(f"resume: {path} holds a pickle that is not plain tensors and containers, refused "
                          f"unread: {' '.join(str(e).split())[:300]}") from None
    except Exception as e:  # files whose hashes match what was saved and still do not load
        raise ConfigError(f"resume: {path} passed its checks but could not be loaded ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}); move it out of {path.parent} to resume from an "
                          "older checkpoint") from None
    for name, obj in states.items():
        obj.load_state_dict(info["states"][name])
    step = int(info["step"])
    why = loaded(step) if loaded else None
    if why:
        raise ConfigError(f"resume: {path}: {why}; its marker was edited: move it out of {path.parent} to "
                          "resume from an older checkpoint")
    if info["processes"] != accelerator.num_processes:
        accelerator.print(f"resume: note: {path} was written by {info['processes']} processes, this run has "
                          f"{accelerator.num_processes}: the batches (and the loss curve) differ from there on")
    return step


def _check_identity(path: Path, old, new: dict) -> None:
    """Refuse to continue, from `path`, a run other than this one, naming what differs."""
    new = json.loads(json.dumps(new))  # as the marker holds it (tuples as lists)
    if old == new:
        return
    if not isinstance(old, dict):
        raise ConfigError(f"resume: {path} does not say which run wrote it; start again in another output_dir")
    said = []
    for key in differences(old, new):
        if key.startswith("settings/"):
            name = key[len("settings/"):]
            was, now = (side.get("settings", {}).get(name, "unset") for side in (old, new))
            said.append(f"{name} {was} -> {now}")
        elif key == "data":
            said.append("the training data (its tokens differ)")
        elif key.startswith("model_files"):
            said.append(f"the model's files ({key.split('/', 1)[-1]})")
        else:
            said.append(key)
    said = list(dict.fromkeys(said))
    raise ConfigError(f"resume: {path} was written by another run: {', '.join(said)}; resume with the settings it "
                      "was made with, or start again in another output_dir")


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
    text = "".join(kept)
    write_file(log, lambda tmp: tmp.write_text(text))


def _contents(folder: Path) -> dict[str, dict]:
    names = [str(f.relative_to(folder)) for f in sorted(folder.rglob("*")) if f.is_file()]
    digests = sha256_many([folder / n for n in names])
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}
