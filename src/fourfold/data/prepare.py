"""A run's token files: the user's, or its corpus tokenized (and, for data.packing = documents,
packed into windows) once into the cache, where every later run and rank finds them."""

from __future__ import annotations

import os
from pathlib import Path

from fourfold.config import ConfigError, DataSection
from fourfold.data import corpus


def tokens_files(data: DataSection, tokenizer: str) -> tuple[Path, Path]:
    """(tokenizer.json, tokens.npy): the user's (data.tokens, made by `tokenizer`), or the corpus
    prepared (and cached) now with `tokenizer` (a tokenizer.json; "": a byte-level BPE trained on it)."""
    if data.tokens:
        if not tokenizer:
            raise ValueError("data.tokens needs data.tokenizer (the tokenizer.json that made it)")
        return Path(tokenizer), Path(data.tokens)
    try:
        return corpus.prepare(data.text or None, data.vocab, os.path.expanduser(data.cache_dir), files=data.files,
                              tokenizer=tokenizer, field=data.field, skip_bad=data.skip_bad_records,
                              workers=data.workers)
    except ValueError as e:  # a corpus file the checks before launch could not see into
        raise ConfigError(f"data: {e}") from None


def packed_windows(data: DataSection, seq: int, tokenizer_path: Path, tokens_path: Path) -> Path | None:
    """With data.packing = "documents", the file of the windows of `seq` + 1 tokens (made by the
    first call, in the cache, and found there by the others); else None."""
    if data.packing != "documents":
        return None
    return corpus.document_windows(tokens_path, seq, corpus.end_of_document(tokenizer_path), data.cache_dir)
