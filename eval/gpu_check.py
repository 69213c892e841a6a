"""The GPU check's Python half (eval/gpu_check.sh runs the steps; this checks the carried files, compares the
perplexity cells with the committed CPU ones, and writes the summary).

    python -m eval.gpu_check wheels --dir .whl [--try-import DIR]   # every pinned wheel present, its metadata right
    python -m eval.gpu_check pack --wheels .whl --model GGUF --out .gpu-stage   # the carried files in parts
    python -m eval.gpu_check parts --parts .gpu-stage --group wheels model     # the parts that hold these groups
    python -m eval.gpu_check stage --parts .gpu-stage --staged DIR [--group G ...]  # stage the carried parts, join
                                                                    # every file whose parts are all staged
    python -m eval.gpu_check staged --staged DIR --group wheels [model fa4]    # the joined files of the groups
    python -m eval.gpu_check ppl-compare RESULTS --reference FILE ... --out FILE
    python -m eval.gpu_check summary --steps FILE --out OUT          # OUT/summary.json, OUT/summary.md

The wheels the check carries are listed in eval/gpu_wheels.txt (eval/gpu_wheels.sh downloads them): the ones
hfpatch needs on the GPU machine's image, then, after the line "# [fa4]", FlashAttention-4 and what it needs
(installed by the check only: the studies run the paths they ran before).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import BinaryIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WHEEL_LIST = HERE / "gpu_wheels.txt"
# torch, transformers and hfpatch are imported only by the steps that need them (env, summary): on the GPU machine
# `model` stages the carried parts before the carried wheels are installed, with the machine's bare Python

# The bf16 perplexity cell may differ from the committed fp32 CPU cell by this much mean NLL (nats per token):
# bf16 keeps 8 bits of mantissa, so every matmul output carries a relative error of about 2^-9 and a 30-layer model's
# logits drift by a few 1e-3 relative; averaged over 32k tokens that moves the mean NLL by about 1e-2. 0.03 nats
# (3 % of perplexity) leaves room for that and still catches a wrong path, which moves it by tenths of a nat or more.
NLL_TOLERANCE = 0.03
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# One carried part of the staged files (hfpatch's wheels, SmolLM2's GGUF, FlashAttention-4's wheels, one byte
# stream): 46 MiB, so that a call's 64 MiB holds a part, the tree (9 MiB tracked) and the texts (.gpu-data, 4 MiB).
PART_SIZE = 46 * 1024**2
CALL_LIMIT = 64 * 1024**2
FA4_MARK = "# [fa4]"  # eval/gpu_wheels.txt: the wheels after this line are FlashAttention-4's
# The stream's order: what every study installs first (hfpatch's wheels, the model), FlashAttention-4's wheels (the
# check's alone) last, so that a study needs only the first parts
GROUPS = ("wheels", "model", "fa4")
JOINED = "JOINED.json"  # staged/files/JOINED.json: {name: SHA-256} of the files joined and checked


# ------------------------------------------------------------------------------------------------------- wheels

def pinned(group: str | None = None) -> dict[str, str]:
    """{name: version} of the wheels the check carries (eval/gpu_wheels.txt: NAME==VERSION, # comments), or of one
    group: "wheels" (before the FA4_MARK line) or "fa4" (after it)."""
    pins = {}
    current = "wheels"
    for raw in WHEEL_LIST.read_text().splitlines():
        if raw.strip().startswith(FA4_MARK):
            current = "fa4"
        line = raw.split("#")[0].strip()
        if line and group in (None, current):
            name, _, version = line.partition("==")
            pins[normal(name)] = version
    return pins


def normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_metadata(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        fields = {}
        for line in z.read(meta).decode().splitlines():
            key, sep, value = line.partition(": ")
            if not sep:
                break
            fields.setdefault(key, value)
    return fields


def check_wheels(folder: Path) -> dict:
    """Each pinned NAME==VERSION has one wheel in `folder` whose metadata says so, for cp312 manylinux x86-64."""
    pins = pinned()
    found: dict[str, list[str]] = {}
    problems = []
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    for w in wheels:
        meta = wheel_metadata(w)
        name, version = normal(meta["Name"]), meta["Version"]
        found.setdefault(name, []).append(version)
        if name not in pins:
            problems.append(f"{w.name} is not in eval/gpu_wheels.txt")
        elif version != pins[name]:
            problems.append(f"{w.name}: version {version}, eval/gpu_wheels.txt pins {pins[name]}")
        tags = w.name[:-4].split("-")[-3:]  # python, abi, platform
        if not (tags[2] == "any" or "x86_64" in tags[2]) or not any(t in tags[0] for t in ("py3", "cp312", "cp3",
                                                                                            "py312")):
            problems.append(f"{w.name}: not a cp312 manylinux x86-64 wheel")
    problems += [f"{n}=={v} missing" for n, v in pins.items() if n not in found]
    problems += [f"{n}: {len(v)} wheels ({', '.join(v)}); pip installs one" for n, v in found.items() if len(v) > 1]
    size = sum(w.stat().st_size for w in wheels)
    return {"wheels": len(wheels), "bytes": size, "problems": problems}


def try_import(folder: Path, scratch: Path) -> dict:
    """Install the wheels this Python can take into `scratch` (not the venv) and import them from there; the others
    (tagged for Python 3.12 only) are checked by their metadata alone."""
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    takes, metadata_only = [], []
    for w in sorted(folder.glob("*.whl")):
        py = w.name[:-4].split("-")[-3]
        (takes if ("py3" in py.split(".") or "cp310" in py or here in py) else metadata_only).append(w)
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(scratch), *map(str, takes)], check=True)
    names = sorted({wheel_metadata(w)["Name"] for w in takes})
    modules = [m for m in ("transformers", "huggingface_hub", "tokenizers", "gguf", "datasets") if
               normal(m) in {normal(n) for n in names}]
    code = ("import importlib, importlib.metadata as md, json; print(json.dumps({m: [md.version(m), "
            f"importlib.import_module(m).__file__] for m in {modules!r}}}))")
    env = {**os.environ, "PYTHONPATH": f"{scratch}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"importing the wheels from {scratch} failed:\n{out.stderr[-2000:]}")
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    outside = [m for m, (_, where) in imported.items() if not where.startswith(str(scratch))]
    return {"imported": {m: v for m, (v, _) in imported.items()}, "imported_from_elsewhere": outside,
            "metadata_only": [w.name for w in metadata_only]}


# -------------------------------------------------------------------------------------------------------- model

def group_of(path: Path) -> str:
    """A carried file's group: "model" (a .gguf), "fa4" (a wheel of FlashAttention-4's group) or "wheels"."""
    if path.suffix == ".gguf":
        return "model"
    return "fa4" if normal(wheel_metadata(path)["Name"]) in pinned("fa4") else "wheels"


def pack(files: list[Path], parts: Path, part_size: int = PART_SIZE) -> list[Path]:
    """The files one after another as one byte stream, group by group in GROUPS' order (within a group, as given),
    cut into parts of part_size bytes, each in a folder of its own (one carried path per call): parts/N/part and
    parts/N/MANIFEST.json = {"files": [{"name", "group", "bytes", "sha256"}, ...] in stream order, "bytes",
    "parts", "part_bytes"}. Written whole or not at all."""
    grouped = sorted(((group_of(f), f) for f in files), key=lambda gf: GROUPS.index(gf[0]))
    files = [f for _, f in grouped]
    entries: list[dict] = [{"name": f.name, "group": g, "bytes": f.stat().st_size, "sha256": sha256(f)}
                           for g, f in grouped]
    total = sum(f.stat().st_size for f in files)
    count = max(1, -(-total // part_size))
    manifest = json.dumps({"files": entries, "bytes": total, "parts": count, "part_bytes": part_size})
    tmp = parts.with_name(parts.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for i in range(1, count + 1):
        (tmp / str(i)).mkdir(parents=True)
        (tmp / str(i) / "MANIFEST.json").write_text(manifest)
    with _PartWriter(tmp, part_size) as out:
        for f in files:
            with open(f, "rb") as src:
                while block := src.read(1 << 22):
                    out.write(block)
    shutil.rmtree(parts, ignore_errors=True)
    tmp.rename(parts)
    return sorted(parts.iterdir(), key=lambda p: int(p.name))


class _PartWriter:
    """Writes a byte stream into folder/1/part, folder/2/part, ..., part_size bytes each."""

    def __init__(self, folder: Path, part_size: int):
        self.folder, self.size, self.index, self.left = folder, part_size, 0, 0
        self.file: BinaryIO | None = None

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()

    def write(self, data: bytes) -> None:
        while data:
            if self.left == 0:
                if self.file is not None:
                    self.file.close()
                self.index += 1
                self.file = open(self.folder / str(self.index) / "part", "wb")  # noqa: SIM115 (closed above)
                self.left = self.size
            chunk, data = data[:self.left], data[self.left:]
            assert self.file is not None
            self.file.write(chunk)
            self.left -= len(chunk)


def stage(parts: Path, staged: Path) -> dict:
    """Copy the carried parts (parts/N/part) into `staged` (outside the tree: it outlives a call on a warm
    machine) and cut every file whose bytes are all staged back out of the stream, into staged/files/<name>, each
    checked against the manifest's SHA-256 (a file that differs is not kept). A part of another pack (another
    manifest) replaces what was staged. Returns {"complete": every file joined, "missing": [parts not staged],
    "groups": {group: [its parts not staged]}, "bad": [files that differ], "detail"}."""
    staged.mkdir(parents=True, exist_ok=True)
    for folder in sorted(parts.glob("*")) if parts.is_dir() else []:
        if (folder / "part").is_file():
            manifest_text = (folder / "MANIFEST.json").read_text()
            if _manifest_text(staged) not in (None, manifest_text):
                _clear(staged)
            shutil.copyfile(folder / "part", staged / f"part.{folder.name}")
            (staged / "MANIFEST.json").write_text(manifest_text)
    manifest = _manifest(staged)
    if manifest is None:
        return {"complete": False, "missing": [], "groups": {}, "bad": [], "detail": "no part was carried (bash "
                "eval/gpu_wheels.sh makes them in .gpu-stage/)"}
    bad = _join(staged, manifest)
    missing = _missing(staged, manifest, range(1, manifest["parts"] + 1))
    groups = {g: _missing(staged, manifest, parts_of(manifest, [g])) for g in GROUPS if _entries(manifest, g)}
    joined = [g for g in groups if staged_files(staged, g)]
    detail = (f"parts {_numbers(staged_parts(staged, manifest))} of {manifest['parts']} staged; joined, SHA-256 "
              f"checked: {', '.join(joined) or 'no group yet'}"
              + "".join(f"; {g} waits for parts {_numbers(m)}" for g, m in groups.items() if m)
              + (f"; joined files differ from the manifest's SHA-256 (carry their parts again): {bad}" if bad else ""))
    return {"complete": not missing and not bad and len(joined) == len(groups), "missing": missing,
            "groups": groups, "bad": bad, "detail": detail}


def parts_of(manifest: dict, groups: list[str]) -> list[int]:
    """The parts (numbered from 1) that hold bytes of the groups' files."""
    return sorted({i for entry, start in _spans(manifest) if entry["group"] in groups
                   for i in _span_parts(start, entry["bytes"], manifest["part_bytes"])})


def staged_parts(staged: Path, manifest: dict) -> list[int]:
    """The parts staged whole (a part of another size counts as not carried)."""
    return [i for i in range(1, manifest["parts"] + 1) if (staged / f"part.{i}").is_file()
            and (staged / f"part.{i}").stat().st_size == _part_size(manifest, i)]


def _part_size(manifest: dict, i: int) -> int:
    return min(manifest["part_bytes"], manifest["bytes"] - (i - 1) * manifest["part_bytes"])


def missing_parts(staged: Path, groups: list[str]) -> list[int]:
    """The parts holding bytes of the groups that are not staged yet ([] when no part is: no manifest names them)."""
    manifest = _manifest(staged)
    if manifest is None:
        return []
    return _missing(staged, manifest, parts_of(manifest, groups))


def staged_files(staged: Path, group: str) -> list[Path]:
    """The joined files of a group ("model", "wheels", "fa4"), in stream order, once every one of them is joined
    from its staged parts and checked against the manifest's SHA-256 (stage() joins them); [] until then."""
    manifest = _manifest(staged)
    if manifest is None:
        return []
    entries = _entries(manifest, group)
    done = _joined(staged)
    files = staged / "files"
    if not entries or any(done.get(e["name"]) != e["sha256"] or not (files / e["name"]).is_file() for e in entries):
        return []
    return [files / e["name"] for e in entries]


def why_not_staged(staged: Path, group: str) -> str:
    """Why staged_files(staged, group) is empty, in one line."""
    manifest = _manifest(staged)
    if manifest is None:
        return f"nothing is staged in {staged} (carry .gpu-stage parts: bash eval/gpu_check.sh --stage)"
    if not _entries(manifest, group):
        return f"the staged files hold no {group} (bash eval/gpu_wheels.sh left it out: see what it printed)"
    missing = missing_parts(staged, [group])
    if missing:
        return (f"{group} needs parts {_numbers(missing)} of {manifest['parts']}, not carried yet (bash "
                "eval/gpu_check.sh --stage carrying .gpu-stage/N)")
    return f"{group}'s parts are staged but its files differ from the manifest's SHA-256: carry its parts again"


def _manifest_text(staged: Path) -> str | None:
    path = staged / "MANIFEST.json"
    return path.read_text() if path.is_file() else None


def _manifest(staged: Path) -> dict | None:
    text = _manifest_text(staged)
    return read_manifest(text, staged / "MANIFEST.json") if text is not None else None


def read_manifest(text: str, where: Path) -> dict:
    """A MANIFEST.json of pack(), refusing one without the part size (an older gpu_wheels.sh's)."""
    manifest = json.loads(text)
    if "part_bytes" not in manifest:
        raise ValueError(f"{where} names no part size: its parts were made by an older eval/gpu_wheels.sh; run it "
                         "again and carry the new parts")
    return manifest


def _clear(staged: Path) -> None:
    """Forget another pack's staged parts and files."""
    for old in staged.glob("part.*"):
        old.unlink()
    shutil.rmtree(staged / "files", ignore_errors=True)


def _entries(manifest: dict, group: str) -> list[dict]:
    return [e for e in manifest["files"] if e["group"] == group]


def _spans(manifest: dict) -> list[tuple[dict, int]]:
    """(entry, its first byte's offset in the stream), in stream order."""
    out, start = [], 0
    for entry in manifest["files"]:
        out.append((entry, start))
        start += entry["bytes"]
    return out


def _span_parts(start: int, n: int, part_bytes: int) -> range:
    """The parts (from 1) holding stream bytes [start, start + n)."""
    return range(start // part_bytes + 1, (start + n - 1) // part_bytes + 2) if n else range(0)


def _missing(staged: Path, manifest: dict, numbers: range | list[int]) -> list[int]:
    have = set(staged_parts(staged, manifest))
    return [i for i in numbers if i not in have]


def _numbers(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers)) or "none"


def _joined(staged: Path) -> dict[str, str]:
    path = staged / "files" / JOINED
    return json.loads(path.read_text()) if path.is_file() else {}


def _join(staged: Path, manifest: dict) -> list[str]:
    """Cut out of the staged parts every file not joined yet whose parts are all staged, and keep it if its SHA-256
    is the manifest's (recorded in files/JOINED.json); returns the names of those that differ."""
    files = staged / "files"
    files.mkdir(exist_ok=True)
    done, bad = _joined(staged), []
    have = set(staged_parts(staged, manifest))
    for entry, start in _spans(manifest):
        target = files / entry["name"]
        needed = _span_parts(start, entry["bytes"], manifest["part_bytes"])
        if (done.get(entry["name"]) == entry["sha256"] and target.is_file()) or not set(needed) <= have:
            continue
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as out:
            _copy_span(staged, manifest["part_bytes"], start, entry["bytes"], out)
        if sha256(tmp) != entry["sha256"]:
            tmp.unlink()
            bad.append(entry["name"])
            continue
        tmp.replace(target)
        done[entry["name"]] = entry["sha256"]
        write_json = files / (JOINED + ".tmp")
        write_json.write_text(json.dumps(done))
        write_json.replace(files / JOINED)
    return bad


def _copy_span(staged: Path, part_bytes: int, start: int, n: int, out: BinaryIO) -> None:
    """Stream bytes [start, start + n) from staged/part.1, part.2, ... into `out`."""
    while n:
        index, offset = divmod(start, part_bytes)
        with open(staged / f"part.{index + 1}", "rb") as f:
            f.seek(offset)
            while n and offset < part_bytes:
                data = f.read(min(n, part_bytes - offset, 1 << 22))
                if not data:  # staged_parts counts only parts of their full size: this one changed since
                    raise ValueError(f"{staged}/part.{index + 1} is shorter than the manifest says: carry it again")
                out.write(data)
                n, start, offset = n - len(data), start + len(data), offset + len(data)


def print_staged(staged: Path, groups: list[str]) -> int:
    """The joined files of the groups on stdout, one per line; else nothing there, and on stderr why not, a line per
    group that is not joined (exit 1)."""
    files = {g: staged_files(staged, g) for g in groups}
    why = [f"gpu_check staged: {why_not_staged(staged, g)}" for g in groups if not files[g]]
    if why:
        print("\n".join(why), file=sys.stderr)
        return 1
    print("\n".join(str(f) for g in groups for f in files[g]))
    return 0


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------- ppl

def ppl_compare(results: Path, references: list[Path], tolerance: float = NLL_TOLERANCE) -> dict:
    """Every cell of `results` against the cell of the same patch and length in the reference files."""
    ref = {(c["patch"], c["length"]): (c, str(p)) for p in references for c in json.loads(p.read_text())["cells"]}
    got = json.loads(results.read_text())
    rows = []
    for c in got["cells"]:
        r, source = ref.get((c["patch"], c["length"]), (None, None))
        row = {"patch": c["patch"], "length": c["length"], "mean_nll": c["mean_nll"], "ppl": c["ppl"],
               "attention_path": c.get("attention_path"), "seconds": c.get("seconds")}
        if r is None:
            row["status"] = "no reference cell"
        else:
            diff = c["mean_nll"] - r["mean_nll"]
            row.update(reference_mean_nll=r["mean_nll"], reference_ppl=r["ppl"], reference=source,
                       diff=diff, status="agrees" if abs(diff) <= tolerance else "differs")
        rows.append(row)
    return {"tolerance_nats": tolerance, "dtype": got["settings"]["dtype"], "versions": got.get("versions"),
            "cells": rows, "agree": bool(rows) and all(r["status"] == "agrees" for r in rows)}


# ------------------------------------------------------------------------------------------------------ summary

def junit_summary(path: Path) -> dict:
    """Passed / failed / skipped (with reasons) of pytest's junit XML."""
    if not path.is_file():
        return {}
    out: dict = {"passed": 0, "failed": [], "skipped": {}}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif skipped is not None:
            reason = (skipped.get("message") or "").removeprefix("Skipped: ")
            out["skipped"][reason] = out["skipped"].get(reason, 0) + 1
        else:
            out["passed"] += 1
    return out


def read_steps(path: Path) -> list[dict]:
    """The step records gpu_check.sh appended: one JSON object per line."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def summary(out: Path, steps: list[dict], env: dict) -> dict:
    data = {"env": env, "steps": steps, "tests": junit_summary(out / "junit.xml")}
    for name in ("bench_infer", "bench_train"):
        if (out / f"{name}.json").is_file():
            cells = json.loads((out / f"{name}.json").read_text())["cells"]
            data[name] = {k: {f: v.get(f) for f in ("seconds", "first_call", "peak", "ran", "error", "skipped")}
                          for k, v in cells.items()}
    if (out / "ppl.json").is_file():
        data["ppl"] = json.loads((out / "ppl.json").read_text())
    data["ok"] = all(s["status"] in ("ok", "skipped") for s in steps)
    return data


def tests_summary(tests: dict) -> str:
    """junit_summary's counts as a line ("N passed, M failed; K skipped: why"), then one line per failed test."""
    skipped = "".join(f"; {n} skipped: {why}" for why, n in tests["skipped"].items())
    return (f"{tests['passed']} passed, {len(tests['failed'])} failed{skipped}"
            + "".join(f"\n- failed: {name}" for name in tests["failed"]))


def summary_markdown(data: dict) -> str:
    from hfpatch.evaluate.report import markdown_table  # after the carried wheels are installed (see the top)

    env = data["env"]
    lines = [f"GPU check on {env.get('device', '?')}: torch {env.get('torch', '?')}, transformers "
             f"{env.get('transformers', '?')}, Python {env.get('python', '?')}"
             + (" (dry run: CUDA-only steps skipped)" if env.get("dry_run") else ""), ""]
    lines.append(markdown_table(["step", "status", "seconds", "detail"],
                                [[s["name"], s["status"], f"{s['seconds']:.0f}", s.get("detail", "")]
                                 for s in data["steps"]]))
    tests = data.get("tests")
    if tests:
        lines += ["", f"Tests (pytest -m cuda): {tests_summary(tests)}"]
    ppl = data.get("ppl")
    if ppl:
        rows = [[c["patch"], c["length"], f"{c['ppl']:.3f}",
                 f"{c['reference_ppl']:.3f}" if "reference_ppl" in c else "",
                 f"{c['diff']:+.4f}" if "diff" in c else "", c["status"]] for c in ppl["cells"]]
        lines += ["", f"Perplexity ({ppl['dtype']}) against the committed CPU cells (agree: |mean NLL difference| <= "
                  f"{ppl['tolerance_nats']} nats):",
                  markdown_table(["patch", "length", "ppl", "reference ppl", "mean NLL diff", "status"], rows)]
    return "\n".join(lines)


def environment(dry_run: bool) -> dict:
    import torch  # after the carried wheels are installed (see the top)
    import transformers

    import hfpatch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    return {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "hfpatch": hfpatch.__version__,
            "python": platform.python_version(), "dry_run": dry_run}


# --------------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="check the carried wheels")
    w.add_argument("--dir", default=str(ROOT / ".whl"))
    w.add_argument("--try-import", metavar="SCRATCH", help="also install the wheels this Python takes into SCRATCH "
                   "and import them from there")
    pk = sub.add_parser("pack", help="cut the wheels and the GGUF into carried parts")
    pk.add_argument("--wheels", default=str(ROOT / ".whl"))
    pk.add_argument("--model", help="the GGUF (left out when not given)")
    pk.add_argument("--out", default=str(ROOT / ".gpu-stage"))
    pk.add_argument("--part-mib", type=float, default=PART_SIZE / 1024**2)
    pt = sub.add_parser("parts", help="print the numbers of the parts that hold the groups' files")
    pt.add_argument("--parts", default=str(ROOT / ".gpu-stage"))
    pt.add_argument("--group", nargs="+", choices=GROUPS, required=True)
    st = sub.add_parser("stage", help="stage the carried parts; join every file whose parts are all staged")
    st.add_argument("--parts", default=str(ROOT / ".gpu-stage"))
    st.add_argument("--staged", default="/tmp/hfpatch-gpu-stage")
    st.add_argument("--group", nargs="+", choices=GROUPS, help="exit 0 once these groups are joined (default: "
                    "every group)")
    sd = sub.add_parser("staged", help="print the joined files of the groups, one per line, group by group (exit 1 "
                        "naming the parts a group still needs)")
    sd.add_argument("--staged", default="/tmp/hfpatch-gpu-stage")
    sd.add_argument("--group", nargs="+", choices=GROUPS, required=True)
    c = sub.add_parser("ppl-compare", help="compare a perplexity results file with reference cells")
    c.add_argument("results")
    c.add_argument("--reference", nargs="+", required=True)
    c.add_argument("--out", required=True)
    s = sub.add_parser("summary", help="write OUT/summary.json and OUT/summary.md, print the Markdown")
    s.add_argument("--steps", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dry-run", action="store_true")
    e = sub.add_parser("env", help="print the versions and the device")
    e.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # a manifest of an older pack
        print(f"gpu_check {args.command}: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.command == "wheels":
        result = check_wheels(Path(args.dir))
        if not result["wheels"]:
            print(f"no wheels in {args.dir}: run bash eval/gpu_wheels.sh first", file=sys.stderr)
            return 2
        if args.try_import and not result["problems"]:
            result.update(try_import(Path(args.dir), Path(args.try_import)))
        print(json.dumps(result, indent=1))
        return 1 if result["problems"] or result.get("imported_from_elsewhere") else 0
    if args.command == "pack":
        files = sorted(Path(args.wheels).glob("*.whl"), key=lambda w: w.name)
        files += [Path(args.model)] if args.model else []
        for part in pack(files, Path(args.out), int(args.part_mib * 1024**2)):
            print(part)
        return 0
    if args.command == "parts":
        found = sorted(Path(args.parts).glob("*/MANIFEST.json"))
        if not found:
            print(f"no parts in {args.parts}: run bash eval/gpu_wheels.sh first", file=sys.stderr)
            return 2
        print(" ".join(map(str, parts_of(read_manifest(found[0].read_text(), found[0]), args.group))))
        return 0
    if args.command == "stage":
        result = stage(Path(args.parts), Path(args.staged))
        print(result["detail"], file=sys.stderr)
        wanted = args.group or list(result["groups"])
        done = not result["bad"] and bool(result["groups"]) and all(
            staged_files(Path(args.staged), g) for g in wanted)
        return 0 if done else 1
    if args.command == "staged":
        return print_staged(Path(args.staged), args.group)
    if args.command == "ppl-compare":
        result = ppl_compare(Path(args.results), [Path(r) for r in args.reference])
        Path(args.out).write_text(json.dumps(result, indent=1))
        for row in result["cells"]:
            print(f"{row['patch']} @ {row['length']}: mean NLL {row['mean_nll']:.4f}"
                  + (f" vs {row['reference_mean_nll']:.4f} ({row['diff']:+.4f})" if "diff" in row else "")
                  + f": {row['status']}")
        return 0 if result["agree"] else 1
    if args.command == "env":
        print(json.dumps(environment(args.dry_run)))
        return 0
    out = Path(args.out)
    env = environment(args.dry_run)
    data = summary(out, read_steps(Path(args.steps)), env)
    (out / "summary.json").write_text(json.dumps(data, indent=1))
    text = summary_markdown(data)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
