"""A small byte-level BPE tokenizer for a from-scratch model (the `tokenizer:` of the pretrain and compare recipes).

Why: a tiny model with SmolLM2's 49,152-token vocabulary spends most of its compute in the LM head (256 x 49,152
multiply-adds per token against about 3M for four 256-wide blocks), so on a CPU it sees few tokens per minute and
stays near unigram statistics. A vocabulary of a few thousand pieces makes every step about four times cheaper.
Byte-level, so every text is encodable; EOS is added between documents by the recipes' packing.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ..lm.text import documents

SPECIAL = ["<pad>", "<s>", "</s>"]
SMALLEST = 256 + len(SPECIAL)  # every byte, and the special tokens


def train_tokenizer(text_files, vocab_size: int, out: str) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` pieces on `text_files` (files or folders of .txt; None: the default
    corpus) and save it in folder `out`; returns it."""
    if vocab_size < SMALLEST:
        raise ValueError(f"vocab_size must be at least {SMALLEST} (256 bytes + {len(SPECIAL)} special tokens), got "
                         f"{vocab_size}")
    docs = list(documents(text_files))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    print(f"{len(fast)} tokens, trained on {len(docs)} document(s): {out}")
    return fast
