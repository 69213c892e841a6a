"""hfpatch search: the command line of the search, built from its declared options (options.py). Parsing, --help
and a bad flag's error load no torch; the model is loaded, and the search imported, once the arguments parse."""

from __future__ import annotations

import sys
import time
from typing import Any

from ..utils import command
from .options import SearchOptions, build_parser

PROG = "hfpatch search"


def main(argv: list[str] | None = None) -> int:
    return command.run_main(_main, sys.argv[1:] if argv is None else argv, PROG,
                            interrupted="run the same command again to continue the search from the results file")


def _main(argv: list[str] | None) -> int:
    started = time.perf_counter()  # the wall-time budget counts the loading too
    args = build_parser(PROG).parse_args(argv)
    opts = SearchOptions.from_args(args)  # every option checked before the model is loaded (seconds to minutes)
    from ..evaluate.common import check_device
    from ..lm.tokenizer import load_tokenizer
    from ..models import model_fingerprint
    from .api import search

    check_device(opts.device)

    tok = load_tokenizer(opts.model)
    model = _load(opts)
    search(model, tok, opts, started=started, identity={"model_type": model.config.model_type,
                                                        "model_files": model_fingerprint(opts.model),
                                                        "dtype": str(model.dtype)})
    return 0


def _load(opts: SearchOptions) -> Any:
    """The model in the dtype asked for ("fast": bf16 where the device computes in it natively, else fp32), on the
    device asked for, in eval mode."""
    import torch

    from ..evaluate.common import torch_dtype
    from ..models import load

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = opts.dtype if opts.dtype != "fast" else ("bf16" if native_bf16(device) else "fp32")
    model, _ = load(opts.model, dtype=torch_dtype(name), device_map=None, tokenizer=False)
    return model.to(device).eval()  # type: ignore[arg-type]  # (mypy reads transformers' @wraps(Module.to) as unbound)


def native_bf16(device: str) -> bool:
    """Whether `device` computes matrix products in bf16 natively: a CUDA GPU that supports bf16, or a CPU with AMX
    or AVX-512 BF16 (oneDNN's bf16 kernels)."""
    import torch

    if device.startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
