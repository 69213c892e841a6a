"""The vLLM side of `--engine vllm`: a worker that runs in vLLM's own Python and answers JSON lines.

hfpatch starts it as `VLLM_PYTHON vllm_worker.py` (this file, by path) and writes one request per line to its stdin;
it writes one answer per line to its stdout. It imports only the standard library and vLLM, so that it runs in a
virtual environment that has vLLM and not hfpatch (vLLM pins its own transformers and torch). Requests:

    {"op": "load", "model": FOLDER, "max_model_len": N, "dtype": "float32", "seed": 0, "memory_fraction": 0.5}
        -> {"ok": true, "vllm": VERSION}   (replaces the model loaded before, if any)
    {"op": "logprobs", "ids": [...], "first": K}
        -> {"logprobs": [...]}   log p(ids[i] | ids[:i]) for i = max(K, 1) .. len(ids)-1, from vLLM's
                                 prompt_logprobs (and the last one from the generated position's logprobs)
    {"op": "greedy", "ids": [...], "max_tokens": N, "stop": [...]}
        -> {"tokens": [...]}   greedy continuation, stopped after a token in "stop" or N tokens
    {"op": "quit"} or the end of stdin -> exits

A request that fails is answered {"error": MESSAGE} and the worker goes on. vLLM's own output (logs, progress
bars) goes to stderr: stdout carries the answers only.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any, TextIO


def _answers() -> TextIO:
    """The stream answers are written to: the process's stdout, which is then pointed at stderr, so that whatever
    vLLM or its libraries print cannot be read as an answer."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


# The share of the device's memory vLLM reserves (of the host's on its CPU backend, where it refuses to start when
# less than that is free: its default, 0.92, fails on any machine running something else)
MEMORY_FRACTION = 0.5


class Worker:
    def __init__(self) -> None:
        self.llm = None

    def load(self, req: dict) -> dict:
        import vllm

        self.close()
        self.llm = vllm.LLM(model=req["model"], tokenizer=req["model"], skip_tokenizer_init=True,
                            max_model_len=int(req["max_model_len"]), dtype=req.get("dtype", "float32"),
                            seed=int(req.get("seed", 0)), enforce_eager=True, enable_prefix_caching=False,
                            max_num_seqs=1, max_num_batched_tokens=int(req["max_model_len"]),
                            max_logprobs=-1, disable_log_stats=True,
                            gpu_memory_utilization=float(req.get("memory_fraction", MEMORY_FRACTION)))
        return {"ok": True, "vllm": vllm.__version__}

    def logprobs(self, req: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt

        ids, first = [int(i) for i in req["ids"]], int(req["first"])
        # vLLM generates at least one token after a prompt, and a sequence may not exceed max_model_len: the prompt
        # is ids without its last token, whose log-probability is read off the generated position's full
        # distribution (logprobs=-1), so that a window of max_model_len tokens is scored whole
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=-1, detokenize=False)
        out = self._generate(TokensPrompt(prompt_token_ids=ids[:-1]), params)
        per_token = out.prompt_logprobs  # [None, {id: Logprob}, ...]: the first token has no context
        per_token = [*per_token[: len(ids) - 1], out.outputs[0].logprobs[0]]
        return {"logprobs": [per_token[i][ids[i]].logprob for i in range(max(first, 1), len(ids))]}

    def greedy(self, req: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt

        ids = [int(i) for i in req["ids"]]
        params = SamplingParams(max_tokens=int(req["max_tokens"]), temperature=0.0, detokenize=False,
                                stop_token_ids=[int(t) for t in req.get("stop", [])], ignore_eos=True)
        out = self._generate(TokensPrompt(prompt_token_ids=ids), params)
        return {"tokens": list(out.outputs[0].token_ids)}

    def _generate(self, prompt, params) -> Any:
        if self.llm is None:
            raise RuntimeError("no model loaded: send a 'load' request first")
        return self.llm.generate([prompt], params, use_tqdm=False)[0]

    def close(self) -> None:
        if self.llm is not None:
            self.llm = None
            gc.collect()


def main() -> int:
    answers = _answers()
    worker = Worker()
    ops = {"load": worker.load, "logprobs": worker.logprobs, "greedy": worker.greedy}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            if req.get("op") not in ops:
                raise ValueError(f"unknown op {req.get('op')!r}; the ops are {', '.join(ops)} and quit")
            answer = ops[req["op"]](req)
        except Exception as e:  # the request fails, the worker stays up for the next one
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
