"""hfpatch.save_pretrained writes a README.md model card: Hub front matter (library_name, hfpatch's tags, the base
model when known), the patch, the windows and how to load it; a card the user wrote keeps its text and front matter
keys, and hfpatch's section between its markers is replaced on the next save, never duplicated."""

from __future__ import annotations

import warnings

import yaml

import hfpatch
from hfpatch import tiny
from hfpatch.interop.io import CARD_END, CARD_START


def _front(text: str) -> dict:
    return yaml.safe_load(text.split("---\n")[1])


def test_a_saved_model_has_a_card_saying_how_to_load_it(tmp_path):
    native = hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=2.0)
    hfpatch.save_pretrained(native, tmp_path / "yarn")
    card = (tmp_path / "yarn" / "README.md").read_text()
    assert _front(card) == {"library_name": "transformers", "tags": ["hfpatch", "yarn"]}
    assert "`yarn:2`" in card and f"Trained window: {tiny.WINDOW} tokens; extended window: {2 * tiny.WINDOW}" in card
    assert "AutoModelForCausalLM.from_pretrained" in card
    alibi = hfpatch.patch(tiny.build_tiny("llama"), position="alibi")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.save_pretrained(alibi, tmp_path / "alibi")
    card = (tmp_path / "alibi" / "README.md").read_text()
    assert "hfpatch.from_pretrained(" in card and "alibi" in _front(card)["tags"]
    # a model loaded from a folder names it as its base model
    hfpatch.save_pretrained(hfpatch.from_pretrained(tmp_path / "yarn"), tmp_path / "again")
    assert _front((tmp_path / "again" / "README.md").read_text())["base_model"] == str(tmp_path / "yarn")


def test_a_card_the_user_wrote_is_kept_and_the_hfpatch_section_replaced(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- mine\n---\n# My model\n\nMy words.\n")
    model = hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=2.0)
    hfpatch.save_pretrained(model, tmp_path)
    hfpatch.patch(model, position="ntk", factor=4.0)
    hfpatch.save_pretrained(model, tmp_path)
    card = (tmp_path / "README.md").read_text()
    front = _front(card)
    assert front["license"] == "apache-2.0" and front["tags"][:2] == ["mine", "hfpatch"] and "ntk" in front["tags"]
    assert "# My model\n\nMy words.\n" in card
    assert card.count(CARD_START) == 1 and card.count(CARD_END) == 1
    assert "`ntk:4`" in card and "`yarn:2`" not in card
