"""lm-evaluation-harness bridge: a model class registered with lm-eval under the name `hfpatch`.

    hfpatch lm-eval --model hfpatch --model_args pretrained=smollm2,patch=yarn:2,dtype=float32 --tasks ... --device cpu

    import hfpatch.evaluate.harness            # registers "hfpatch" with lm-eval
    lm_eval.simple_evaluate(model="hfpatch", model_args="pretrained=smollm2,patch=yarn:2", tasks=[...])

It is lm-eval's own `hf` model (HFLM: every model_arg, batching, devices, accelerate data parallelism) with two
differences: MODEL is read as everywhere in hfpatch (a folder — a model saved patched by hfpatch comes back patched
—, a .gguf file, a hub id, or `smollm2`), and `patch` (a spec as in `--patches`: yarn:2, ntk:4, dynamic, none)
is applied once the model is loaded. lm-eval then reads the patched model's max_position_embeddings as its
max_length (yarn:2 on an 8k model: 16k); pass max_length=... to choose another.

lm-eval 0.4 finds models only in its own registry (no plugin entry points), so the `lm_eval` command cannot see
`hfpatch` unless it is registered first: `hfpatch lm-eval ARGS` is the `lm_eval` command with it registered by name
(lm_eval_command.py: this module is imported when lm-eval first asks for the model), and takes every lm_eval
argument. Needs the optional extra: pip install 'hfpatch[lm-eval]'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import hfpatch

from .. import spec
from ..models import resolve
from .lm_eval_command import INSTALL, main  # noqa: F401 (the command, importable from here too)

try:
    import lm_eval.models  # noqa: F401 (lm-eval's own models first: its registry imports them only while empty)
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError:  # the optional extra is not installed
    HFLM = None

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def parse_patch(text: str) -> dict:
    """patch=... of --model_args: one spec string (none, yarn:2, ...), validated before anything is loaded."""
    kwargs = spec.parse(str(text))
    try:
        spec.request(**kwargs)
    except (ValueError, TypeError) as e:
        raise type(e)(f"patch={text!r}: {e}") from None
    return kwargs


class _Loader:
    """What HFLM calls AUTO_MODEL_CLASS: hfpatch's loading, so that a model saved patched comes back patched."""

    @staticmethod
    def from_pretrained(pretrained: str, **kwargs: Any) -> PreTrainedModel:
        kwargs = {k: v for k, v in kwargs.items() if not (k in ("gguf_file", "quantization_config") and v is None)}
        if kwargs.get("subfolder") == "":
            kwargs.pop("subfolder")
        return hfpatch.from_pretrained(pretrained, **kwargs)


if HFLM is not None:

    @register_model("hfpatch")
    class HFPatchLM(HFLM):
        AUTO_MODEL_CLASS = _Loader  # causal LMs only, as everywhere in hfpatch

        def __init__(self, pretrained: str = "smollm2", patch: str = "none", device: str | None = None,
                     **kwargs: Any) -> None:
            self.patch_spec = str(patch)
            self._patch_kwargs = parse_patch(self.patch_spec)
            where, gguf_file = resolve(str(pretrained))
            if gguf_file:
                kwargs.setdefault("gguf_file", gguf_file)
            kwargs.setdefault("dtype", "float32")
            super().__init__(pretrained=where, device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
                             **kwargs)

        def _create_model(self, pretrained: str, **kwargs: Any) -> None:
            super()._create_model(pretrained, **kwargs)
            if self._patch_kwargs:
                hfpatch.patch(self._model, **self._patch_kwargs)
            self._config = hfpatch.apply.unwrap(self._model).config  # max_length follows the patched window

        def get_model_info(self) -> dict:
            info = super().get_model_info()
            info["hfpatch"] = {"patch": self.patch_spec, "version": hfpatch.__version__,
                               "position": hfpatch.describe(self._model)["position"]}
            return info
