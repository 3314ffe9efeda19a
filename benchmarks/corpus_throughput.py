"""Tokenizing a generated corpus: fourfold's streaming path (worker processes, a memory-mapped
token file) against a single-process loop with the same tokenizer (the whole text in one string,
each document encoded in turn, the ids in a Python list, as fourfold did before). Each path runs
in its own process; its peak RSS is that of its whole process tree, sampled every 50 ms, and its
CPU seconds are those of the tree too (on a machine shared with other work the wall-clock speed
depends on the load, which is printed: CPU seconds show what each path costs).

    python benchmarks/corpus_throughput.py --size-mb 1024 [--workers N] [--dir DIR]

The corpus: documents of 200 to 5000 words drawn by the King James Bible's word frequencies,
lines of about 12 words, separated by fourfold's end-of-text marker. The tokenizer: a byte-level
BPE of 4096 tokens trained on its first 20 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from fourfold.data import corpus


def generate(path: Path, size: int, seed: int = 0) -> int:
    """Writes `size` bytes (about) of documents; returns their number."""
    counts = Counter(corpus.bundled_text().replace(corpus.EOS, " ").split())
    words = np.array(list(counts))
    p = np.array(list(counts.values()), dtype=np.float64)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    written = documents = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            drawn = rng.choice(words, size=rng.integers(200, 5000), p=p).tolist()
            lines = [" ".join(drawn[i : i + 12]) for i in range(0, len(drawn), 12)]
            written += f.write("\n".join(lines) + corpus.EOS)
            documents += 1
    return documents


def train_tokenizer(text_path: Path, out: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer

    with open(text_path, encoding="utf-8") as f:
        sample = f.read(20 << 20).split(corpus.EOS)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(sample, vocab_size=4096, min_frequency=2, special_tokens=[corpus.EOS], show_progress=False)
    bpe.save(str(out))


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its finished children (the workers)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in usage)


def run_streaming(text: str, tokenizer: str, out: str, workers: int) -> None:
    _, tokens = corpus.prepare(None, 0, out, files=text, tokenizer=tokenizer, workers=workers, progress=False)
    print(json.dumps({"tokens_path": str(tokens), "cpu": cpu_seconds()}))


def run_loop(text: str, tokenizer: str, out: str) -> None:
    tok = corpus.load_tokenizer(tokenizer)
    eos = corpus.end_of_document(tokenizer)
    ids = []
    for doc in Path(text).read_text(encoding="utf-8").split(corpus.EOS):
        if doc:
            ids.extend(tok.encode(doc).ids)
            ids.append(eos)
    path = Path(out) / "loop.npy"
    np.save(path, np.asarray(ids, dtype=np.uint16))
    print(json.dumps({"tokens_path": str(path), "cpu": cpu_seconds()}))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants now (0 once it has gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) << 10
            for task in os.listdir(f"/proc/{p}/task"):
                todo += map(int, Path(f"/proc/{p}/task/{task}/children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def measure(args: list[str]) -> dict:
    """Runs this script with `args` in a new process: its seconds, peak tree RSS, the load average
    (1 minute) at its end, and its result."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed with exit code {proc.returncode}")
    result = json.loads(proc.stdout.read().strip().splitlines()[-1])
    return dict(result, seconds=seconds, peak=peak, load=os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--workers", type=int, default=0, help="streaming worker processes (0: one per core)")
    parser.add_argument("--dir", default="", help="where to write the corpus and token files (default: a temp dir)")
    parser.add_argument("--run", choices=["streaming", "loop"], help=argparse.SUPPRESS)  # one measured path
    parser.add_argument("--text", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run == "streaming":
        return run_streaming(args.text, args.tokenizer, args.dir, args.workers)
    if args.run == "loop":
        return run_loop(args.text, args.tokenizer, args.dir)

    with tempfile.TemporaryDirectory(dir=args.dir or None) as folder:
        folder = Path(folder)
        text, tokenizer = folder / "corpus.txt", folder / "tokenizer.json"
        start = time.perf_counter()
        documents = generate(text, int(args.size_mb * 2**20))
        size = text.stat().st_size
        print(f"generated {size / 2**20:.0f} MiB, {documents} documents, in {time.perf_counter() - start:.0f} s")
        train_tokenizer(text, tokenizer)
        workers = args.workers or len(os.sched_getaffinity(0))
        common = ["--text", str(text), "--tokenizer", str(tokenizer), "--dir", str(folder)]
        streaming = measure(["--run", "streaming", "--workers", str(workers), *common])
        loop = measure(["--run", "loop", *common])
        tokens = np.load(streaming["tokens_path"], mmap_mode="r")
        same = np.array_equal(tokens, np.load(loop["tokens_path"], mmap_mode="r"))
        print(f"{len(tokens)} tokens; the two token files are {'identical' if same else 'DIFFERENT'}; "
              f"{os.cpu_count()} CPUs")
        print(f"{'path':<28}{'seconds':>9}{'MiB/s':>9}{'CPU s':>9}{'peak RSS MiB':>14}{'load (1 min)':>14}")
        for name, r in ((f"streaming, {workers} workers", streaming), ("single-process loop", loop)):
            print(f"{name:<28}{r['seconds']:>9.1f}{size / 2**20 / r['seconds']:>9.2f}{r['cpu']:>9.1f}"
                  f"{r['peak'] / 2**20:>14.0f}{r['load']:>14.1f}")
        print(f"streaming / loop: speed x{loop['seconds'] / streaming['seconds']:.2f}, CPU seconds "
              f"x{streaming['cpu'] / loop['cpu']:.2f}, peak RSS x{streaming['peak'] / loop['peak']:.3f}")


if __name__ == "__main__":
    main()
