"""Prompts and tokenizers.

`ByteTokenizer` (tests, tiny models): one token per UTF-8 byte after BOS, no files needed.
`SentencePieceTokenizer` loads PaliGemma's tokenizer model from a local path (never from a hub).

pi0.5's prompt writes the discretised state into the text (openpi):
"Task: pick up the bowl, State: 12 200 31;\\nAction: "; pi0 and pi0.5-on-LIBERO use the task alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError

PAD, BOS = 0, 1
BYTE_VOCAB_SIZE = 258  # pad, bos, 256 bytes


class ByteTokenizer:
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return [BOS] + [b + 2 for b in text.encode("utf-8")]


class SentencePieceTokenizer:
    def __init__(self, path: str | Path):
        try:
            import sentencepiece
        except ImportError:
            raise KilovlaError("a SentencePiece tokenizer needs `pip install sentencepiece`") from None
        if not Path(path).is_file():
            raise KilovlaError(f"{path}: tokenizer model not found")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.vocab_size()

    def encode(self, text: str) -> list[int]:
        return [self._sp.bos_id()] + self._sp.encode(text)


def discretize_state(state: np.ndarray, bins: int = 256) -> list[int]:
    """State normalised to [-1, 1] -> bin indices, as openpi writes it into the prompt."""
    edges = np.linspace(-1, 1, bins + 1)[:-1]
    return (np.digitize(np.clip(state, -1, 1), edges) - 1).tolist()


def build_prompt(task: str, state: np.ndarray | None = None) -> str:
    task = task.strip().replace("_", " ")
    if state is None:
        return task + "\n"
    return f"Task: {task}, State: {' '.join(map(str, discretize_state(state)))};\nAction: "


def tokenize_batch(tokenizer, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens (B, L) and mask (B, L), L = the longest prompt (<= max_length; longer ones are cut)."""
    ids = [tokenizer.encode(p)[:max_length] for p in prompts]
    length = max(len(i) for i in ids)
    tokens = torch.full((len(ids), length), PAD, dtype=torch.long)
    mask = torch.zeros(len(ids), length, dtype=torch.bool)
    for row, seq in enumerate(ids):
        tokens[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = True
    return tokens, mask
