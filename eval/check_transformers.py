"""Re-check hfpatch against a transformers release: one command.

    python -m eval.check_transformers                      # the newest transformers on PyPI, in a scratch venv
    python -m eval.check_transformers --transformers 5.25.0
    python -m eval.check_transformers --python .venv/bin/python --update-baseline   # the environment at hand

It builds a scratch venv (torch as pinned in constraints.txt, this checkout installed editable, the requested
transformers and whatever it resolves with it), runs the family sweep there (tests/test_tiny.py: every causal-LM family
builds tiny, runs and generates; tests/test_families.py: the RoPE families through yarn / unpatch / save-reload /
alibi-nope / norm swaps) and `hfpatch supported`, and compares per family with the sweep this version ships
(hfpatch/data/sweep.json) and the supported table of that version (eval/results/families/supported.json):

- new: a model type the baseline did not have;
- changed: what hfpatch accepts for it, or a sweep check, differs (and how);
- broken: a sweep test fails or the family no longer builds (with the error).

It prints a Markdown report and writes it as JSON (--out). With --update-baseline and nothing broken, the sweep and
supported table become the new baseline (the routine for raising transformers' upper bound: docs/maintenance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
BASELINE_SWEEP = REPO / "hfpatch" / "data" / "sweep.json"
BASELINE_SUPPORTED = REPO / "eval" / "results" / "families" / "supported.json"
SWEEP_TESTS = ["tests/test_tiny.py", "tests/test_families.py"]
_PARAM = re.compile(r"\[([^\]]+)\]$")
# hfpatch.families.DECODE_CHECK, written out: this script runs on any Python and imports hfpatch only in the venv
DECODE_CHECK = "f_decode:"


def pinned(name: str) -> str | None:
    """The version constraints.txt pins for `name`."""
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.lower().startswith(name.lower() + "=="):
            return line.split("==", 1)[1].strip()
    return None


def make_venv(where: Path, transformers: str) -> Path:
    """A fresh venv with pinned torch, this checkout and the requested transformers ("latest": the newest)."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    py = where / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={pinned('torch')}"], check=True)
    wanted = "transformers" if transformers == "latest" else f"transformers=={transformers}"
    subprocess.run([*pip, "-e", f"{REPO}[test]", "gguf", "--upgrade", wanted], check=True)
    return py


def run_sweep(py: Path, work: Path) -> dict:
    """{"transformers": version, "tests": {model_type: [failure messages]}, "rope_checks": ..., "supported": ...}."""
    junit, sweep_out, supported_out = work / "junit.xml", work / "sweep.json", work / "supported.json"
    env = {**os.environ, "HFPATCH_SWEEP_OUT": str(sweep_out)}
    subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *SWEEP_TESTS],
                   cwd=REPO, env=env, check=False)
    # what hfpatch accepts per family, before the sweep is read (its status and failed decoding checks are read
    # against the baseline being checked)
    code = ("import json, sys; from hfpatch.families import measure_raw; "
            "json.dump(measure_raw(use_cache=False), open(sys.argv[1], 'w'), indent=1, sort_keys=True)")
    subprocess.run([str(py), "-c", code, str(supported_out)], cwd=REPO, env=env, check=True)
    version = subprocess.run([str(py), "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return {"transformers": version, "tests": failures(junit),
            "rope_checks": json.loads(sweep_out.read_text()) if sweep_out.is_file() else {},
            "supported": json.loads(supported_out.read_text())}


def failures(junit: Path) -> dict:
    """{model_type or test name: [failure message, ...]} from pytest's JUnit XML."""
    out: dict = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is None:
            continue
        m = _PARAM.search(case.get("name", ""))
        key = m.group(1) if m else case.get("name", "?")
        out.setdefault(key, []).append(" ".join((bad.get("message") or "").split())[:300])
    return out


def _accepts(r: dict) -> dict:
    """What hfpatch accepts for one family, as comparable data."""
    if not r.get("built") or "patches" not in r:
        return {"built": r.get("built", False), "reason": r.get("reason", "")}
    p = r["patches"]
    return {"position": sorted(p["position"]), "norm": bool(p["norm"]),
            "exact_layernorm_to_rmsnorm": p["exact_layernorm_to_rmsnorm"], "placement": sorted(p["placement"])}


def compare(run: dict, sweep: dict, supported: dict) -> dict:
    """{"new": [...], "changed": {type: [what]}, "broken": {type: [error]}} of `run` against the baseline."""
    new = sorted(set(run["supported"]) - set(sweep["model_types"]))
    removed = sorted(set(sweep["model_types"]) - set(run["supported"]))
    broken = {t: msgs for t, msgs in run["tests"].items()
              if not _only_decoding_failed(run["rope_checks"].get(t, {}))}
    changed: dict = {}
    for t in sorted(set(run["supported"]) & set(supported)):
        before, after = _accepts(supported[t]), _accepts(run["supported"][t])
        diffs = [f"{k}: {before.get(k)} -> {after.get(k)}" for k in sorted(set(before) | set(after))
                 if before.get(k) != after.get(k)]
        if before.get("built") is not False and after.get("built") is False:
            broken.setdefault(t, []).append(f"no longer builds: {after['reason']}")
        old_checks, new_checks = sweep["rope_checks"].get(t, {}), run["rope_checks"].get(t, {})
        diffs += [f"{c}: {old_checks.get(c)} -> {new_checks.get(c)}" for c in sorted(set(old_checks) | set(new_checks))
                  if old_checks.get(c) != new_checks.get(c)]
        if diffs:
            changed[t] = diffs
    return {"new": new, "removed": removed, "changed": changed, "broken": broken}


def _only_decoding_failed(checks: dict) -> bool:
    """Whether a family's sweep failed only cached-decoding checks: recorded in the sweep, which is what makes
    `hfpatch supported` leave those schemes out, so a change to show (under changed), not a break."""
    failed = [k for k, v in checks.items() if v.startswith("FAIL")]
    return bool(failed) and all(k.startswith(DECODE_CHECK) for k in failed)


def report(run: dict, verdict: dict, baseline: list) -> str:
    lines = [f"# hfpatch family sweep on transformers {run['transformers']} (baseline: {', '.join(baseline)})", "",
             f"- model types: {len(run['supported'])}; new: {len(verdict['new'])}; not in this release: "
             f"{len(verdict['removed'])}; changed: {len(verdict['changed'])}; broken: {len(verdict['broken'])}", ""]
    for title, key in (("New", "new"), ("Changed", "changed"), ("Broken", "broken")):
        lines.append(f"## {title}")
        entries = verdict[key]
        if not entries:
            lines.append("none")
        elif isinstance(entries, list):
            positions = {t: ", ".join(_accepts(run["supported"][t]).get("position", [])) or "none" for t in entries}
            lines += [f"- {t}: position: {positions[t]}" for t in entries]
        else:
            lines += [f"- {t}: {'; '.join(msgs)}" for t, msgs in sorted(entries.items())]
        lines.append("")
    if verdict["removed"]:
        lines += ["## In the baseline, not in this release", ", ".join(verdict["removed"]), ""]
    return "\n".join(lines)


def update_baseline(run: dict, sweep: dict) -> None:
    """Add the run's transformers to the versions the sweep passed on, and its families to those measured. The
    checks and the supported table are those of the newest version passed."""
    newest = all(Version(run["transformers"]) >= Version(v) for v in sweep["passed_on"])
    BASELINE_SWEEP.write_text(json.dumps({
        "passed_on": sorted(set(sweep["passed_on"]) | {run["transformers"]}, key=Version),
        "model_types": sorted(set(sweep["model_types"]) | set(run["supported"])),
        "rope_checks": run["rope_checks"] if newest else sweep["rope_checks"]}, indent=1, sort_keys=True) + "\n")
    if newest:
        BASELINE_SUPPORTED.parent.mkdir(parents=True, exist_ok=True)
        BASELINE_SUPPORTED.write_text(json.dumps({"transformers": run["transformers"], "families": run["supported"]},
                                                 indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transformers", default="latest", help="version to check (default: the newest on PyPI)")
    p.add_argument("--python", type=Path, help="use this environment's python instead of making a scratch venv")
    p.add_argument("--out", type=Path, default=Path("runs/check_transformers.json"), help="the report as JSON")
    p.add_argument("--update-baseline", action="store_true",
                   help="if nothing is broken, make this run the shipped sweep and supported table")
    args = p.parse_args(argv)
    sweep = json.loads(BASELINE_SWEEP.read_text()) if BASELINE_SWEEP.is_file() else \
        {"passed_on": [], "model_types": [], "rope_checks": {}}
    supported = json.loads(BASELINE_SUPPORTED.read_text())["families"] if BASELINE_SUPPORTED.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="hfpatch-check-") as tmp:
        py = args.python.absolute() if args.python else make_venv(Path(tmp) / "venv", args.transformers)
        run = run_sweep(py, Path(tmp))
    verdict = compare(run, sweep, supported)
    print(report(run, verdict, sweep["passed_on"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"transformers": run["transformers"], **verdict}, indent=1, sort_keys=True))
    if args.update_baseline:
        if verdict["broken"]:
            print("baseline not updated: some families are broken", file=sys.stderr)
            return 1
        update_baseline(run, sweep)
        print(f"baseline updated: {BASELINE_SWEEP.relative_to(REPO)}, {BASELINE_SUPPORTED.relative_to(REPO)}")
    return 1 if verdict["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
