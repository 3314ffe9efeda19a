"""The checks that read a run's data files, before any process starts: the corpus files a
pattern names, the user's tokenizer and token file against the model's vocabulary (read chunk by
chunk: a file of any size), and end-of-document ids for document packing."""

from __future__ import annotations

import numpy as np

from fourfold.config import ConfigError, TrainConfig
from fourfold.data.corpus import check_document_ends, end_of_document, input_files, load_tokenizer, token_range


def check_data_files(cfg: TrainConfig) -> None:
    """The corpus files data.files names (each pattern matches a file), the user's tokenizer and
    token file (data.tokens) against the model's vocabulary, before any process starts; the token
    file is read once, chunk by chunk (any size). `validate` has checked that both files exist; a
    tokenizer trained here is bounded by data.vocab, which it checked too."""
    d, tokenizer = cfg.data, cfg.tokenizer
    if d.files:
        try:
            input_files(d.files)
        except ValueError as e:
            raise ConfigError(f"data.files: {e}") from None
    if not tokenizer:
        return
    vocab = cfg.model_config().vocab
    try:
        size = load_tokenizer(tokenizer).get_vocab_size()
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
        raise ConfigError(f"tokenizer {tokenizer} is not a tokenizer.json the tokenizers library reads ({e}); "
                          f"give a tokenizer.json (the one that made data.tokens, if given)") from None
    if size > vocab:
        raise ConfigError(f"tokenizer {tokenizer} has {size} tokens, more than the model's vocabulary of "
                          f"{vocab}; give the model's own tokenizer (its tokenizer.json) and tokens made with it")
    if d.tokens:
        check_token_ids(d.tokens, vocab, "data.tokens")
        if d.packing == "documents":
            _check_documents(d.tokens, tokenizer)


def _check_documents(path: str, tokenizer: str) -> None:
    """data.packing = "documents" needs the tokenizer's end-of-document id between the documents of
    data.tokens (fourfold's own token files have one after each document)."""
    try:
        check_document_ends(np.load(path, mmap_mode="r", allow_pickle=False), end_of_document(tokenizer))
    except ValueError as e:
        raise ConfigError(f"data.tokens {path}: {e}") from None


def check_token_ids(path: str, vocab: int, option: str) -> None:
    """A token file (given as `option`) against the model's vocabulary, read chunk by chunk: a file
    of any size is checked without loading it."""
    try:
        lo, hi = token_range(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{option} {path}: {e}; give a .npy file of token ids (numpy.save of a 1-D array)") from None
    if lo < 0 or hi >= vocab:
        raise ConfigError(f"{option} {path} holds id {hi if hi >= vocab else lo}, outside the model's vocabulary "
                          f"[0, {vocab}); tokenize the data with the model's tokenizer")
