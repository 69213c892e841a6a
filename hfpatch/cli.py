"""Patch a Hugging Face transformers model's position encoding (RoPE scaling such as YaRN, Self-Extend, ALiBi,
NoPE, ...) or its norms (LayerNorm, RMSNorm, pre/post placement), save it, and measure what the change did
(perplexity, passkey, RULER, needle in a haystack).

    hfpatch describe MODEL
    hfpatch patch MODEL --position yarn --factor 4 --out DIR
    hfpatch patch MODEL --position yarn --factor 4 --attention-temperature logn --out DIR
    hfpatch patch MODEL --position yarn --factor 4 --layers nope@every4 --out DIR   (NoPE in every 4th layer)
    hfpatch patch MODEL.gguf --position yarn --factor 4 --out MODEL-yarn4.gguf   (llama.cpp's RoPE metadata)
    hfpatch supported
    hfpatch eval ppl ...        (hfpatch eval ppl --help)
    hfpatch eval passkey ...
    hfpatch eval ruler ...
    hfpatch eval niah ...
    hfpatch lm-eval ...         (lm-evaluation-harness's lm_eval command, with --model hfpatch registered)
    hfpatch search --model smollm2 --target-length 32k --budget 2h --out DIR   (hfpatch search --help)
    hfpatch card DIR --results RUN_DIR [RUN_DIR ...]   (the runs' tables and plots in DIR's model card)
    hfpatch patch MODEL --spec-file DIR/best.json --out DIR2

MODEL: a hub id, a local folder, a .gguf file, or "smollm2" (the embedded default). Bad input: one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import patch_options
from .evaluate import EVALUATIONS
from .patch_options import scheme_options
from .plugins import PluginError, load_plugins
from .utils.command import Parser, UsageError, run_main
from .utils.files import Lock, describe_os_error, write_folder
from .utils.warn import NeedsCalibrationWarning


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def _temperature(text: str) -> str | dict:
    from .spec import parse_temperature

    try:
        return parse_temperature(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _boolean(text: str) -> bool:
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _scheme_name(text: str) -> str:
    """As patch(position=...) reads a scheme's name (any case, "_" for "-"), refused with the registry's own message
    (the valid names, and the hint for a spec string such as "yarn:4")."""
    from .position.registry import request  # the registries import torch: only when a --position is parsed

    try:
        request(text, {})
    except ValueError as e:
        if str(e).startswith("unknown position scheme"):
            raise argparse.ArgumentTypeError(str(e)) from None
        # a known scheme that needs options (factor=): they are checked with the others, once parsed
    return text.strip().lower().replace("_", "-")


def _numbers(text: str) -> list:
    """A list of numbers: JSON ("[1, 1.5]") or comma-separated ("1,1.5")."""
    try:
        value = json.loads(text) if text.strip().startswith("[") else [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers, as [1, 1.5] or 1,1.5; got {text!r}") from None
    return value


# An option's form on the command line (registry.Option.kind) -> add_argument keywords
_FORMS: dict[str, dict] = {"number": {"type": float}, "integer": {"type": int}, "flag": {"type": _boolean},
                           "numbers": {"type": _numbers}, "names": {"nargs": "+"}}


def _layer_group(text: str) -> tuple[str, object]:
    from .spec import parse_layer_group

    try:
        return parse_layer_group(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand's arguments are defined (the patch command's dozens of flags
    are built only for it). No subcommand's --help imports torch: the patch flags come from hfpatch.patch_options,
    the registries' light declaration. Each subcommand names its handler."""
    description, _, examples = __doc__.partition("\n\n")
    p = Parser(prog="hfpatch", description=description, epilog="examples:\n" + examples,
               formatter_class=argparse.RawDescriptionHelpFormatter)  # the examples keep their lines
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    d = sub.add_parser("describe", help="what the model is and what can be patched (JSON)")
    d.add_argument("model")
    _loading_flags(d)
    d.set_defaults(func=_describe)

    s = sub.add_parser("patch", help="patch a model and save it")
    if command in (None, "patch"):
        _patch_arguments(s)
    s.set_defaults(func=_patch)

    u = sub.add_parser("supported", help="every causal-LM model type of the installed transformers and the patches "
                                         "each accepts, measured on a tiny model of each (JSON, or --markdown)")
    u.add_argument("model_types", nargs="*", metavar="MODEL_TYPE", help="only these model types (default: all)")
    u.add_argument("--markdown", action="store_true", help="a Markdown table and the counts instead of JSON")
    u.add_argument("--no-cache", action="store_true", help="measure again instead of reading the cached result")
    u.set_defaults(func=_supported)

    e = sub.add_parser("eval", help="evaluate patch specs: " + ", ".join(EVALUATIONS))
    e.add_argument("what", choices=list(EVALUATIONS))
    e.add_argument("rest", nargs=argparse.REMAINDER,
                   help="the arguments of that evaluation (see hfpatch eval ppl --help)")
    e.set_defaults(func=_eval)

    c = sub.add_parser("card", help="add the tables and plots of hfpatch eval runs to the model card of a folder "
                                    "hfpatch saved (a second run replaces them)")
    c.add_argument("folder", metavar="DIR", help="a folder written by hfpatch.save_pretrained or hfpatch patch --out")
    c.add_argument("--results", nargs="+", required=True, metavar="RUN_DIR",
                   help="the --out folders of hfpatch eval runs (each holds results.json and table.md)")
    c.set_defaults(func=_card)

    sub.add_parser("search", help="find the training-free patch that works best at a target length (hfpatch "
                                  "search --help)", add_help=False)

    sub.add_parser("lm-eval", help="lm-evaluation-harness's lm_eval command with --model hfpatch registered "
                                   "(every lm_eval argument follows: hfpatch lm-eval --help)")
    return p


def _patch_arguments(s) -> None:
    offered = patch_options.offered()  # the registries' names, options and help, without importing torch
    schemes, placements = offered["SCHEMES"], offered["PLACEMENTS"]
    s.add_argument("model")
    s.add_argument("--out", required=True, help="folder to save the patched model (and tokenizer) to; a .gguf path "
                                                "with a .gguf model: a copy with llama.cpp's RoPE metadata")
    s.add_argument("--position", metavar="SCHEME", type=_scheme_name,
                   help="the position scheme: " + ", ".join(schemes) + " (what each does and takes: hfpatch docs, "
                        "Patch options)")
    s.add_argument("--factor", type=float, help="context extension ratio (> 1), for the schemes that take one: "
                   + ", ".join(n for n, factor in schemes.items() if factor != "none"))
    for name, (kind, text, owners) in offered["SCHEME_OPTIONS"].items():
        if kind == "layers":  # a repeatable SCHEME@LAYERS flag of its own, below
            continue
        s.add_argument("--" + name.replace("_", "-"), dest=name, **_FORMS[kind], help=f"{text} [{', '.join(owners)}]")
    s.add_argument("--layers", action="append", type=_layer_group, default=[], metavar="SCHEME@LAYERS",
                   help="with a RoPE --position: another scheme (nope, p-rope) in some layers, e.g. nope@every4 "
                        "(layers 3, 7, 11, ...), nope@[3,7,11], p-rope@every2from0:keep=0.5; repeatable")
    s.add_argument("--norm", choices=list(offered["NORMS"]), help="the kind every norm becomes")
    s.add_argument("--no-exact", dest="exact", action="store_false", default=None,
                   help="with --norm rmsnorm: plain swap instead of the exact (weight-folding) conversion")
    s.add_argument("--placement", choices=list(placements), help="where the norms sit in each block")
    for name in sorted({k for options in placements.values() for k in options}):  # --post-fraction (mix)
        owners = ", ".join(k for k, options in placements.items() if name in options)
        s.add_argument("--" + name.replace("_", "-"), type=float, dest=name, help=f"with --placement {owners}")
    s.add_argument("--attention-temperature", type=_temperature, dest="attention_temperature", metavar="KIND",
                   help="a query scale that grows past the trained window: " + ", ".join(offered["TEMPERATURES"])
                        + "; options after colons, e.g. logn:window=4096, llama4:attn_scale=0.1:floor_scale=8192")
    s.add_argument("--opt", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="any option as KEY=VALUE, the value as JSON (e.g. --opt 'short_factor=[1,1,1,1]')")
    s.add_argument("--spec-file", dest="spec_file", metavar="JSON",
                   help="the patch as a JSON object of hfpatch.patch's keyword arguments (hfpatch search writes "
                        "OUT/best.json); other flags add to it, and may not repeat a key it gives")
    s.add_argument("--calibrate", nargs="+", metavar="TEXT",
                   help="text files or folders of .txt files: after patching, hfpatch.calibrate fits DyT's α, "
                        "BatchNorm's running statistics and Peri-LN's output norms to the model they replaced, on "
                        "the first --calibrate-tokens tokens of this text (a pretrained model needs it before "
                        "norm=dyt or norm=batchnorm is used without training)")
    s.add_argument("--calibrate-tokens", type=int, metavar="N", dest="calibrate_tokens",
                   help=f"with --calibrate: the tokens read, in sequences of up to {CALIBRATION_SEQ_LEN} "
                        f"(default {CALIBRATION_TOKENS})")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="load the model in this dtype")
    s.add_argument("--overwrite", action="store_true",
                   help="with a .gguf --out: replace an existing GGUF file there (never a file of another kind); "
                        "with an --out folder that holds files and is not a model hfpatch saved: replace the model "
                        "files there (the other files stay)")
    _loading_flags(s)


def _loading_flags(p) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code the model folder carries, if it needs it (read it first)")
    p.add_argument("--allow-pickled-weights", action="store_true",
                   help="load pytorch_model.bin weights (pickles) when there are no safetensors")


def _loading(args) -> dict:
    return {"trust_remote_code": args.trust_remote_code, "allow_pickled_weights": args.allow_pickled_weights}


def _check_out(out: str, source: str, overwrite: bool = False) -> Path:
    """--out, checked before the model is loaded: a folder that can be created, not the source model's own folder
    (the patched model would replace it), and, without --overwrite, not a folder of other things than a model
    hfpatch saved (its model files would be replaced)."""
    path = Path(out).expanduser()
    for parent in [path, *path.parents]:
        if parent.is_file():
            raise ValueError(f"--out {out}: {parent} is a file, not a folder")
    given = Path(source).expanduser()
    source_dir = given if given.is_dir() else given.parent if given.is_file() else None
    if source_dir is not None and path.exists() and os.path.samefile(path, source_dir):
        raise ValueError(f"--out {out} is the model's own folder: the patched model would replace the original; "
                         "choose another folder")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held and not overwrite and not _saved_by_hfpatch(path):
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ValueError(f"--out {out} holds {shown}, and is not a model hfpatch saved: give a new or empty folder, "
                         "or --overwrite to replace the model files there (config, weights, tokenizer, model card; "
                         "the other files stay)")
    return path


def _saved_by_hfpatch(folder: Path) -> bool:
    """Whether a folder holds a model hfpatch saved: its config.json has the hfpatch section, or its README.md
    hfpatch's card section."""
    from .interop.io import CARD_START

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if isinstance(config, dict) and "hfpatch" in config:
            return True
    except (OSError, ValueError):
        pass
    try:
        return CARD_START in (folder / "README.md").read_text(encoding="utf-8")
    except (OSError, ValueError):
        return False


def saved_model_file(name: str) -> bool:
    """Whether an entry at a model folder's top level is one that saving a model writes, and so one that `hfpatch
    patch --out` replaces or removes there: the config, the generation defaults, the weights (safetensors or
    pickles, one file or numbered shards, and their index), the tokenizer's files, the model card and the plots of
    `hfpatch card`. Anything else (checkpoints, notes, a trainer's state, a .gguf) stays."""
    import fnmatch
    import re

    from .interop.io import PLOTS
    from .models import MODEL_FILE_PATTERNS, MODEL_FILES, VOCAB_FILES

    weights = r"(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin)(\.index\.json)?"
    return (name in MODEL_FILES or name in VOCAB_FILES or name in ("README.md", PLOTS)
            or re.fullmatch(weights, name) is not None
            or any(fnmatch.fnmatchcase(name, p) for p in MODEL_FILE_PATTERNS))


def _save_into(out: Path, model, tok) -> Callable[[Path], None]:
    """How `hfpatch patch` writes the patched model into OUT.partial: the card already in OUT (and the plots it
    links) first, so that the save keeps its text and front matter, and its evaluations if they are of the new
    files (hfpatch.save_pretrained's card rules), then the model."""
    import hfpatch
    from hfpatch.interop.io import PLOTS

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        if (out / "README.md").is_file():
            shutil.copyfile(out / "README.md", tmp / "README.md")
        if (out / PLOTS).is_dir():
            shutil.copytree(out / PLOTS, tmp / PLOTS)
        hfpatch.save_pretrained(model, tmp, tokenizer=tok)

    return write


def _locked(out: Path) -> Lock:
    """OUT.lock beside --out, held until the patched model is saved: two runs writing one --out would share
    OUT.partial (the second is refused, naming the first's process)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Lock(out.with_name(out.name + ".lock"), f"--out {out}")  # Locked: a ValueError, one line
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create it or write beside it ({describe_os_error(e)})") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        load_plugins()  # the extensions installed as packages register themselves before any argument is read
    except PluginError as e:
        print(f"hfpatch: error: {e}", file=sys.stderr)
        return 2
    if argv[:1] == ["search"]:  # every following argument is the search's own, --help included
        from hfpatch.search.command import main as search_main

        return search_main(argv[1:])
    if argv[:1] == ["lm-eval"]:  # every following argument is lm_eval's own, --help included
        from hfpatch.evaluate import lm_eval_command

        return lm_eval_command.main(argv[1:])
    return run_main(lambda a: _run(build_parser(a[0] if a else None).parse_args(a)), argv, "hfpatch")


def _run(args) -> int:
    return args.func(args)


def _eval(args) -> int:
    """hfpatch eval NAME ...: the evaluations parse their own arguments and print their own errors."""
    from hfpatch.evaluate import evaluation

    return evaluation(args.what).main(args.rest)


def _card(args) -> int:
    from hfpatch.evaluate.card import add_results

    readme, left_out = add_results(args.folder, args.results)
    if left_out:
        print(f"hfpatch: warning: left out of the card {len(left_out)} run(s) of another model than {args.folder}: "
              f"{'; '.join(left_out)}", file=sys.stderr)
    print(f"{readme}: the evaluations of {len(args.results) - len(left_out)} run(s)", file=sys.stderr)
    return 0


def _supported(args) -> int:
    from hfpatch.families import markdown, measure

    results = measure(args.model_types or None, use_cache=not args.no_cache,
                      progress=lambda t: print(f"measured {t}", file=sys.stderr, flush=True))
    print(markdown(results) if args.markdown else json.dumps(results, indent=2))
    return 0


def _describe(args) -> int:
    import hfpatch
    from hfpatch.interop.serving import folder_differences
    from hfpatch.models import load

    model, _ = load(args.model, tokenizer=False, **_loading(args))
    info = hfpatch.describe(model)
    serving = folder_differences(args.model)  # a saved folder: what vLLM / SGLang would serve differently
    if serving:
        info["serving"] = serving
    print(json.dumps(info, indent=2, default=str))
    for line in serving:
        print(f"hfpatch: warning: {line}", file=sys.stderr)
    return 0


def _patch_kwargs(args) -> dict:
    """The keyword arguments of hfpatch.patch the command line gives: every flag the registries defined, then
    --opt KEY=VALUE."""
    import hfpatch

    names = ("position", "factor", "norm", "exact", "placement", "attention_temperature", *scheme_options(),
             *hfpatch.spec.all_placement_options())
    kwargs = {k: getattr(args, k) for k in names if k != "layers"}
    kwargs.update(dict(args.opt))
    if args.layers:
        groups = dict(args.layers)
        if len(groups) < len(args.layers):
            raise UsageError("hfpatch patch: error: --layers names the same scheme twice; give its layers once "
                             "(nope@[3,7,11])")
        kwargs["layers"] = groups
    return {k: v for k, v in kwargs.items() if v is not None}


def _patch(args) -> int:
    """hfpatch patch: validate the request before spending time loading the model, then patch and save."""
    import hfpatch
    from hfpatch.models import load

    kwargs = _patch_kwargs(args)
    if args.spec_file:
        from_file = _spec_file(args.spec_file)
        both = sorted(set(from_file) & set(kwargs))
        if both:
            raise UsageError(f"hfpatch patch: error: --spec-file {args.spec_file} and the other flags both give "
                             f"{', '.join(both)}; give each once")
        kwargs = {**from_file, **kwargs}
    if not kwargs:
        raise UsageError("hfpatch patch: error: nothing to patch: give --position, --norm, --placement, "
                         "--attention-temperature or --spec-file")
    _check_calibration_flags(args)
    if args.out.endswith(".gguf"):  # GGUF in, GGUF out: llama.cpp's RoPE metadata, the weights as they are
        return _export_gguf(args, kwargs)
    hfpatch.spec.request(**kwargs)
    out = _check_out(args.out, args.model, args.overwrite)
    dtype = None
    if args.dtype:
        import torch

        dtype = getattr(torch, args.dtype)
    with _locked(out):
        model, tok = load(args.model, dtype=dtype, **_loading(args))
        with warnings.catch_warnings():
            if args.calibrate:  # the calibration below is what that warning asks for
                warnings.simplefilter("ignore", NeedsCalibrationWarning)
            hfpatch.patch(model, **kwargs)
        if args.calibrate:
            hfpatch.calibrate(model, calibration_batches(model, tok, args.calibrate, args.calibrate_tokens))
        # written as OUT.partial, then moved into OUT once complete: a full disk leaves OUT as it was, never half a
        # model; of what OUT held, only the model files are replaced (saved_model_file), the rest stays
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            write_folder(out, _save_into(out, model, tok), saved_model_file)
    for w in caught:  # what the save says (a patch plain transformers cannot express, a card's evaluations dropped)
        print(f"hfpatch: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    info = hfpatch.describe(model)
    print(f"saved {info['family']} with {hfpatch.spec.describe_string(info['applied'])} to {args.out}")
    return 0


CALIBRATION_TOKENS = 4096  # hfpatch patch --calibrate: tokens read by default,
CALIBRATION_SEQ_LEN = 512  # in sequences of this many (or the model's window, if shorter), one batch each
CALIBRATION_MIN_TOKENS = 2  # the fewest tokens of text a calibration takes (a variance needs two samples)


def _check_calibration_flags(args) -> None:
    """--calibrate and --calibrate-tokens, checked before the model is loaded."""
    if args.calibrate_tokens is not None and not args.calibrate:
        raise UsageError("hfpatch patch: error: --calibrate-tokens needs --calibrate TEXT")
    if args.calibrate_tokens is not None and args.calibrate_tokens < CALIBRATION_MIN_TOKENS:
        raise UsageError(f"hfpatch patch: error: --calibrate-tokens must be >= {CALIBRATION_MIN_TOKENS}, got "
                         f"{args.calibrate_tokens}")
    if args.calibrate and args.out.endswith(".gguf"):
        raise UsageError("hfpatch patch: error: --calibrate fits weights, which a .gguf --out does not change (it "
                         "writes RoPE metadata only): save a model folder")
    for path in args.calibrate or ():
        if not os.path.exists(os.path.expanduser(path)):
            raise UsageError(f"hfpatch patch: error: --calibrate {path}: no such file or folder")


def calibration_batches(model, tok, paths: list[str], tokens: int | None) -> list:
    """The first `tokens` tokens of the text files (documents joined by EOS) as [1, seq] batches of token ids,
    seq = CALIBRATION_SEQ_LEN or the model's window if shorter (the last batch may be shorter)."""
    import torch

    from .introspect import position_limit
    from .lm.text import documents, joined_text_ids

    if tok is None:
        raise ValueError("--calibrate needs the model's tokenizer to read the text, and this model has none")
    joined, own = joined_text_ids(tok, documents(text_files_arg=paths), tokens or CALIBRATION_TOKENS)
    if own < CALIBRATION_MIN_TOKENS:
        raise ValueError(f"--calibrate {' '.join(paths)}: the text holds {own} token(s) (the end-of-text tokens "
                         f"joining the files not counted); calibrating needs at least {CALIBRATION_MIN_TOKENS}")
    ids = joined.tolist()
    seq = min(CALIBRATION_SEQ_LEN, position_limit(model) or CALIBRATION_SEQ_LEN)
    device = model.get_input_embeddings().weight.device
    rows = [ids[i: i + seq] for i in range(0, len(ids), seq)]
    return [torch.tensor([row], device=device) for row in rows if len(row) >= 2]


def _spec_file(path: str) -> dict:
    """The keyword arguments of hfpatch.patch that a --spec-file holds (a JSON object with string keys)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--spec-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        why = describe_os_error(e) if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(f"--spec-file {path}: cannot read it ({why})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--spec-file {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if value == {}:
        raise ValueError(f"--spec-file {path} holds no patch ({{}}: the model as it is, what hfpatch search writes "
                         "when no patch beats the unpatched model): there is nothing to patch")
    if not isinstance(value, dict):
        raise ValueError(f"--spec-file {path}: expected a non-empty JSON object of hfpatch.patch's keyword arguments "
                         '(e.g. {"position": "yarn", "factor": 4}), got ' + type(value).__name__)
    return value


def _export_gguf(args, kwargs) -> int:
    from hfpatch.interop.gguf import export
    from hfpatch.models import gguf_path
    from hfpatch.spec import describe_string

    if args.dtype:
        raise UsageError("hfpatch patch: error: --dtype does not apply to a .gguf --out: the weights are copied as "
                         "they are")
    source = gguf_path(args.model)
    if source is None:
        raise UsageError(f"hfpatch patch: error: --out {args.out} is a GGUF file, which needs a .gguf model to copy "
                         "(a transformers folder saves to a folder; convert it with llama.cpp's convert_hf_to_gguf.py)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = export(source, args.out, overwrite=args.overwrite, **kwargs)
    for w in caught:  # what was kept of a scaling made elsewhere: one line each, as describe's warnings
        print(f"hfpatch: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    keys = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in written["metadata"].items()
                     if not k.startswith("hfpatch."))
    tensors = f"; tensors {', '.join(written['tensors'])}" if written["tensors"] else ""
    print(f"wrote {args.out} with {describe_string(written['spec'])}: {keys}{tensors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
