"""Marking tokens by their text: which tokens of a sequence overlap marked characters.

The base policy's loss weights (rule tokens, copied words) and the check's rule-token NLL mark
tokens by what they spell, found as characters in the decoded text."""

from __future__ import annotations

from typing import Sequence


def token_pieces(tokenizer, input_ids: Sequence[int]) -> list[str]:
    """Each token's text, decoded alone; joined, they are the text whose characters are marked."""
    return [tokenizer.decode([t]) for t in input_ids]


def tokens_overlapping(pieces: Sequence[str], hit: Sequence[bool]) -> list[bool]:
    """Per piece, whether any of its characters is marked in `hit` (one flag per character of
    the joined pieces)."""
    out, pos = [], 0
    for piece in pieces:
        out.append(any(hit[pos: pos + len(piece)]))
        pos += len(piece)
    return out
