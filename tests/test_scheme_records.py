"""One registration call per scheme carries everything. tests/outside_schemes.py registers, from outside the package,
a RoPE scaling (`geometric`) and a scheme with its own attention function (`decay`), one `register(...)` call each;
every part of hfpatch picks them up: the patch (checked against a hand computation), save and reload, the GGUF
export and its reading back, the serving engines' keys, `hfpatch search --families`, the attention paths and
describe(). Each runs in a fresh process, so that the registry of the other tests stays as it is. Below them, the
registry's checks of a record, and the built-in records' saved forms against their builders."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hfpatch
from hfpatch.position.attention.paths import AttentionPath
from hfpatch.position.registry import SCHEMES, Scheme, register, rope_scaling
from hfpatch.position.rope import builders
from hfpatch.position.rope.serving import Serving
from hfpatch.position.search_space import Param, Space

TESTS = Path(__file__).resolve().parent


def run_fresh(code: str, tmp_path: Path) -> None:
    """Run `code` in a fresh Python (tests/ on its path, TMP a scratch folder); it prints "ok" when every check
    held."""
    head = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nTMP = {str(tmp_path)!r}\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HFPATCH_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:] + done.stdout[-2000:]


GEOMETRIC = """
import copy, json, math, os, warnings
import torch
import outside_schemes
from conftest import WINDOW, logits, max_diff, tiny_model, tokens
from transformers import AutoModelForCausalLM
import hfpatch

model = tiny_model("llama").eval()
ids = tokens(3 * WINDOW)
before = logits(model, ids)

# the patch: each pair's inverse frequency divided by factor^(i / (n - 1)), computed here in float64
hand = copy.deepcopy(model)
rotary = hand.model.rotary_emb
n = rotary.inv_freq.numel()
theta = hand.config.rope_parameters["rope_theta"]
head_dim = 2 * n
inv = [1.0 / (4.0 ** (i / (n - 1)) * theta ** (2 * i / head_dim)) for i in range(n)]
rotary.inv_freq = torch.tensor(inv, dtype=torch.float64).float()
hfpatch.patch(model, position="geometric", factor=4.0)
assert hfpatch.describe(model)["position"]["scheme"] == "geometric"
assert max_diff(logits(model, ids), logits(hand, ids)) < 1e-5, max_diff(logits(model, ids), logits(hand, ids))
assert model.model.rotary_emb.attention_scaling == 1.0

# save and reload: hfpatch and plain transformers; the serving engines' keys beside transformers' own
folder = os.path.join(TMP, "saved")
hfpatch.save_pretrained(model, folder)
saved = json.load(open(os.path.join(folder, "config.json")))["rope_parameters"]
assert saved["rope_type"] == "longrope" and saved["short_mscale"] == saved["long_mscale"] == 1.0, saved
assert max_diff(logits(hfpatch.from_pretrained(folder).eval(), ids), logits(model, ids)) == 0
assert max_diff(logits(AutoModelForCausalLM.from_pretrained(folder).eval(), ids), logits(model, ids)) == 0
from hfpatch.interop import serving
assert serving.saved_rope_types()["geometric"] == "longrope"
assert "| `geometric` | `longrope` |" in serving.markdown()
assert serving.folder_differences(folder) == [f"vLLM longrope: {serving.ROPE_READERS['vLLM'].behaviour['longrope']}"]

# GGUF: exported, read back from hfpatch's record and from llama.cpp's metadata alone (the scheme's own reader)
from tiny_gguf import write_llama_gguf
import gguf
from hfpatch.interop import gguf as hg
from hfpatch.interop.gguf_file import write_copy
from hfpatch.models import load
plain = tiny_model("llama").eval()
src = write_llama_gguf(plain, os.path.join(TMP, "tiny.gguf"))
out = os.path.join(TMP, "geometric.gguf")
written = hg.export(src, out, position="geometric", factor=4.0)
assert written["tensors"] == ["rope_freqs.weight"] and "geometric" in hg.exportable()
found = hg.read_patch(out)
assert found.source == "record" and found.patch == {"position": "geometric", "factor": 4.0}, found
bare = os.path.join(TMP, "bare.gguf")
write_copy(gguf, gguf.GGUFReader(out), bare, {}, {hg.RECORD_KEY}, {}, set())
found = hg.read_patch(bare)
assert found.source == "metadata" and found.patch == {"position": "geometric", "factor": 4.0,
                                                      "original_max_position_embeddings": WINDOW}, found
loaded, _ = load(bare, tokenizer=False)
hfpatch.patch(plain, position="geometric", factor=4.0)
assert torch.allclose(logits(loaded.eval(), ids), logits(plain, ids), atol=1e-5, rtol=0)
# a reader registered from outside takes no file of another scheme: Llama 3.1's tensor still reads as llama3
hg.export(src, os.path.join(TMP, "l3.gguf"), position="llama3", factor=4.0)
write_copy(gguf, gguf.GGUFReader(os.path.join(TMP, "l3.gguf")), os.path.join(TMP, "l3-bare.gguf"), {},
           {hg.RECORD_KEY}, {}, set())
assert hg.read_patch(os.path.join(TMP, "l3-bare.gguf")).patch["position"] == "llama3"
print("ok")
"""


def test_a_rope_scaling_registered_from_outside_patches_saves_exports_and_serves(tmp_path):
    run_fresh(GEOMETRIC, tmp_path)


SEARCH = """
import json, os
import outside_schemes
from conftest import tiny_model
from hfpatch.cli import main
from hfpatch.search import space
from hfpatch.tiny import char_text, save_sized

# its per-pair factors start the LongRoPE population: read off the patched model, they are the λ_i themselves
setting, _ = space.setting_for(tiny_model("llama"), 64, 256, ["longrope"])
factors, attention = setting.seeds["geometric"]
want = outside_schemes.geometric_factors(4.0, setting.pairs)
assert max(abs(a - b) for a, b in zip(factors, want)) < 1e-6 and attention == 1.0, (factors, want)
# and it is a family of its own
folder = save_sized(os.path.join(TMP, "model"))
texts = os.path.join(TMP, "texts")
os.makedirs(texts)
for i in range(2):
    open(os.path.join(texts, f"d{i}.txt"), "w").write(char_text(1500, i))
code = main(["search", "--model", str(folder), "--target-length", "256", "--text-files", texts, "--budget", "6",
             "--population", "2", "--parents", "2", "--samples", "1", "--families", "geometric", "--no-plot",
             "--no-progress", "--out", os.path.join(TMP, "search")])
assert code == 0, code
cells = [c for c in json.load(open(os.path.join(TMP, "search", "results.json")))["cells"] if c.get("complete")]
assert [c["family"] for c in cells] == ["none"] + ["geometric"] * 5, [c["family"] for c in cells]
assert cells[1]["spec"] == {"position": "geometric", "original_max_position_embeddings": 64, "factor": 4.0}
children = [c["spec"]["factor"] for c in cells[2:]]  # mutated (or crossed) within the declared range
assert all(2.0 <= f <= 8.0 for f in children) and any(f != 4.0 for f in children), children
print("ok")
"""


def test_hfpatch_search_searches_a_rope_scaling_registered_from_outside(tmp_path):
    run_fresh(SEARCH, tmp_path)


DECAY = """
import torch
import outside_schemes
from conftest import logits, max_diff, tiny_model, tokens
import hfpatch
from hfpatch.position.attention import paths

model = tiny_model("llama").eval()
ids = tokens(100)
before = logits(model, ids)
assert [p.name for p in paths.table("decay")] == ["one-sdpa", "written-out"]  # registered with the record
hfpatch.patch(model, position="decay", slope=0.2)
got = logits(model, ids)
ran = hfpatch.describe(model)["position"]["attention_path"]
assert ran["order"] == ["one-sdpa", "written-out"] and set(ran["ran"]) == {"one-sdpa"}, ran
with paths.forcing("decay", "written-out"):
    assert max_diff(logits(model, ids), got) < 1e-5
assert max_diff(got, before) > 1e-3
paths.reset(model)
mask = torch.ones(2, 100, dtype=torch.long)
mask[1, :10] = 0  # left padding: a mask the one-sdpa path does not take
with torch.no_grad():
    model(torch.cat([ids, ids]), attention_mask=mask)
ran = hfpatch.describe(model)["position"]["attention_path"]
assert set(ran["ran"]) == {"written-out"} and ran["passed_over"] == {"one-sdpa": "no bool attention mask"}, ran
hfpatch.unpatch(model)
assert max_diff(logits(model, ids), before) == 0
print("ok")
"""


def test_a_scheme_registered_from_outside_runs_its_own_attention_paths(tmp_path):
    run_fresh(DECAY, tmp_path)


# ------------------------------------------------------------------------------------------- the registry's checks


def _written(module, query, key, value, attention_mask, **kwargs):
    raise AssertionError("never called")


def test_a_record_whose_last_attention_path_cannot_take_every_call_is_refused_and_not_registered():
    record = Scheme(lambda *a: None, (), "a test scheme", paths=(AttentionPath("cpu-only", _written, "",
                                                                                devices=frozenset({"cpu"})),))
    with pytest.raises(ValueError, match="the last path must take every call"):
        register("no-full-path", record)
    assert "no-full-path" not in SCHEMES


@pytest.mark.parametrize(("fields", "says"), [
    ({"search": Space({"beta": Param(1.0, 2.0, 0.1)}, start=lambda s: {"beta": 1.0}, short=("beta",))},
     "its search space varies beta, which it does not take"),
    ({"serving": Serving("yarn", ("factor",))}, "saves as rope_type 'yarn', which 'yarn' saves as"),
])
def test_a_record_whose_fields_do_not_fit_together_is_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        register("misfit", rope_scaling(builders.linear, "a test scheme", **fields))
    assert "misfit" not in SCHEMES


def test_gguf_and_serving_forms_belong_to_rope_rescalings():
    with pytest.raises(ValueError, match="describe a RoPE rescaling, and its record has no rope= builder"):
        register("misfit", Scheme(lambda *a: None, (), "a test scheme", per_pair_seed=True))


def test_each_saved_form_names_the_rope_type_its_builder_writes():
    """What serving.py reads per rope_type is the form the record names: it must be the type the builder saves."""
    sample = {"factor": 2.0, "short_factor": [1.0] * 32, "long_factor": [1.0] * 32}
    for name, scheme in SCHEMES.items():
        if scheme.serving is not None:
            built = scheme.rope({"rope_type": "default", "rope_theta": 1e4}, 4096, sample, 64)
            assert built["rope_type"] == scheme.serving.rope_type, name


def test_the_families_and_seeds_are_the_records_that_declare_them():
    from hfpatch.search import options, space

    assert tuple(space.FAMILIES) == options.FAMILY_NAMES == options.families_offered()
    assert space.seed_schemes() == [n for n, s in hfpatch.position.SCHEMES.items() if s.per_pair_seed]
