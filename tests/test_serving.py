"""What vLLM and SGLang would serve differently from a saved checkpoint (hfpatch.interop.serving): the warnings of
`hfpatch describe` on a saved folder, checked against transformers' own attention factor and the engines' formulas
written out; and docs/serving.md carrying the table the code holds."""

from __future__ import annotations

import json
import math

import pytest
import transformers
from conftest import REPO, WINDOW, tiny_model

import hfpatch
from hfpatch.cli import main
from hfpatch.interop import serving


def saved(tmp_path, **spec):
    model = tiny_model("llama")
    hfpatch.patch(model, **spec)
    with pytest.warns(UserWarning) if not hfpatch.describe(model)["position"].get("native", True) else _nothing():
        hfpatch.save_pretrained(model, tmp_path / "m")
    return str(tmp_path / "m")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plain_yarn_is_served_the_same_everywhere(tmp_path):
    assert serving.folder_differences(saved(tmp_path, position="yarn", factor=4.0)) == []


def test_an_explicit_yarn_attention_factor_is_lost_in_sglang_only(tmp_path):
    """vLLM (0.32) reads YaRN's attention_factor as transformers does; SGLang applies its default."""
    out = serving.folder_differences(saved(tmp_path, position="yarn", factor=4.0, attention_factor=1.3))
    default = 0.1 * math.log(4) + 1  # YaRN's default, what SGLang applies without its own attn_factor
    assert len(out) == 1
    assert out[0].startswith(f"SGLang applies a yarn attention factor of {default:.6g}, transformers 1.3")
    assert "it does not read attention_factor" in out[0]
    assert serving.ROPE_READERS["vLLM"].attention["yarn"][0]({"factor": 4.0, "attention_factor": 1.3}, 0) == 1.3


def test_mscale_pair_is_served_as_transformers_by_both_engines(tmp_path):
    out = serving.folder_differences(saved(tmp_path, position="yarn", factor=4.0, mscale=0.8, mscale_all_dim=0.6))
    assert out == []
    # both formulas give transformers' number (the ratio of the two corrections), by hand:
    by_hand = (0.1 * 0.8 * math.log(4) + 1) / (0.1 * 0.6 * math.log(4) + 1)
    params = {"factor": 4.0, "mscale": 0.8, "mscale_all_dim": 0.6}
    for engine in ("vLLM", "SGLang"):
        assert serving.ROPE_READERS[engine].attention["yarn"][0](params, 4 * WINDOW) == pytest.approx(by_hand)


def test_longrope_attention_and_vllms_long_factors(tmp_path):
    """The saved short_mscale / long_mscale carry transformers' attention factor, explicit or not: what is left is
    vLLM's choice of factors by the served length."""
    spec = dict(position="longrope", factor=4.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    only_factors = [f"vLLM longrope: {serving.ROPE_READERS['vLLM'].behaviour['longrope']}"]
    assert serving.folder_differences(saved(tmp_path, **spec)) == only_factors
    assert serving.folder_differences(saved(tmp_path / "b", **spec, attention_factor=1.0)) == only_factors


def test_dynamic_is_fixed_in_both_engines(tmp_path):
    out = serving.folder_differences(saved(tmp_path, position="dynamic", factor=2.0))
    assert [line.split(" ")[0] for line in out] == ["vLLM", "SGLang"] and all("dynamic" in line for line in out)


def test_a_scheme_config_json_cannot_express_is_served_as_the_original(tmp_path):
    out = serving.folder_differences(saved(tmp_path, position="dynamic-yarn"))
    assert out and "original position encoding" in out[-1]


def test_describe_warns_on_a_saved_folder(tmp_path, capsys):
    folder = saved(tmp_path, position="yarn", factor=4.0, attention_factor=1.3)
    assert main(["describe", folder]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["serving"]) == 1
    warnings = [line for line in captured.err.splitlines() if line.startswith("hfpatch: warning: ")]
    assert len(warnings) == 1 and "SGLang" in warnings[0]


def test_the_docs_page_carries_the_table_of_the_code():
    """docs/serving.md includes the generated table, and the generated table is the code's (eval/docs_tables.py)."""
    assert '--8<-- "docs/generated/serving_engines.md"' in (REPO / "docs" / "serving.md").read_text()
    generated = (REPO / "docs" / "generated" / "serving_engines.md").read_text()
    assert serving.markdown() in generated, "docs/generated/ is stale: run python -m eval.docs_tables"


@pytest.mark.parametrize("rope, served", [({"rope_type": "linear", "factor": 4.0}, 256),
                                          ({"rope_type": "dynamic", "factor": 2.0}, 128),
                                          ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                           64),
                                          (None, 64)])
def test_longest_served_by_vllm_multiplies_the_window_only_where_vllm_does(rope, served):
    """linear and dynamic: vLLM's tables run to max_position_embeddings x factor; yarn and the others take
    max_position_embeddings as the extended window already."""
    config = transformers.LlamaConfig(max_position_embeddings=64)
    if rope is not None:
        config.rope_parameters = {"rope_theta": 10000.0, **rope}
    assert serving.longest_served("vLLM", config) == served
