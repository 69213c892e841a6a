"""docs/extending.md: a new position scheme is one applier and one registered record, in one file, and every part of
hfpatch picks it up — patch and unpatch, the spec string, describe(), the command line's flag and help, the GGUF
export's refusal. Run in a fresh process, so the registry of the other tests stays as it is."""

import subprocess
import sys
import textwrap
from pathlib import Path

# One file: the applier (it scales every RoPE frequency by `shrink`, through the edit log) and its record.
MY_SCHEME = textwrap.dedent('''
    import torch
    from hfpatch.position.registry import Option, Scheme, positive, register
    from hfpatch.position.signal import rotaries_of

    def apply_halved(model, adapter, req, scheme, edits):
        for rotary, _ in rotaries_of(model, adapter):
            edits.set(rotary, "inv_freq", rotary.inv_freq * req.get("shrink", 0.5))

    register("halved", Scheme(apply_halved, ("rope",), "every RoPE frequency times shrink (default 0.5)",
                              options={"shrink": Option(positive, "the factor every frequency is multiplied by")},
                              native=False, gguf_refusal="halved is a test scheme"))
''')

CHECKS = textwrap.dedent('''
    import contextlib, io, sys
    sys.path.insert(0, TESTS)
    exec(MY_SCHEME)
    import torch, hfpatch
    from conftest import logits, tiny_model, tokens
    from hfpatch.cli import build_parser
    from hfpatch.interop import gguf
    model = tiny_model("llama")
    ids = tokens(40)
    before = logits(model, ids)
    hfpatch.patch(model, **hfpatch.spec.parse("halved:shrink=0.25"))
    assert hfpatch.describe(model)["position"]["scheme"] == "halved"
    assert (logits(model, ids) - before).abs().max() > 0
    hfpatch.unpatch(model)
    assert (logits(model, ids) - before).abs().max() == 0
    args = build_parser("patch").parse_args(["patch", "m", "--out", "o", "--position", "halved", "--shrink", "0.3"])
    assert (args.position, args.shrink) == ("halved", 0.3)
    helped = io.StringIO()
    with contextlib.redirect_stdout(helped), contextlib.suppress(SystemExit):
        build_parser("patch").parse_args(["patch", "--help"])
    assert "the factor every frequency is multiplied by [halved]" in " ".join(helped.getvalue().split())
    assert gguf.refusal("halved") == "halved is a test scheme"
    print("ok")
''')


def test_a_scheme_is_one_applier_and_one_record_in_one_file():
    code = f"TESTS = {str(Path(__file__).parent)!r}\nMY_SCHEME = {MY_SCHEME!r}\n" + CHECKS
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
