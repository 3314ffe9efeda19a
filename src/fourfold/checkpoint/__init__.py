"""Training checkpoints with torch.distributed.checkpoint (DCP), in the serial model's names.

Every tensor is stored under its serial name ("model/layers.0.attn.q", "optim/m/...") and full
shape, written in pieces: each rank writes only the rectangles of it that it holds (its z piece of
its (x, y) block, its ZeRO-1 slice of master/m/v: `fourfold.checkpoint.sharded_io`), straight from its own
tensors; ranks holding the same parameters (the trainer's dp*cp replicas; an expert's, under
expert parallelism, its expert replicas: `params.Replicas`) split them, each offering whole ones
(otherwise DCP writes identical rectangles once). Loading onto any grid reads, on each rank,
only the rectangles it holds, into its own tensors (replicas: a share each, then an all-gather).

A save goes to `.step-N.partial/` and is renamed to `step-N/` only after every rank finished
and `meta.json` (step, data position, config, and the manifest of its files) is written; older
checkpoints beyond `keep` are removed after that. A crash during a save therefore leaves the
previous checkpoint intact, and `latest()` never returns a partial one.

The manifest (meta.json's "files") gives every file's size and CRC-32, each computed by the rank
that wrote the file, right after writing it (read back from its page cache: CRC-32 runs at about
2 GB/s, a fraction of a second for a rank's share of even a 405B model's state) and gathered to rank
0, a few dozen bytes per rank. A checkpoint is verified in two halves: `damage` (one process, before
launch) checks that every file is there with its size, a stat per file, so that a missing shard,
a missing `.metadata` or a file cut short is found in seconds even for 16,384 files of terabytes;
`contents_damage` (every rank, before any reads) checks the CRC-32s, each rank reading 1/world of
the files, so that the whole checkpoint is read once across the job rather than by one process.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

from fourfold.checkpoint.sharded_io import Rectangle, RectangleLoadPlanner, RectangleSavePlanner, ShardError, rectangles
from fourfold.parallel import comm
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor import params

META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


STEP = re.compile(r"step-\d+")  # a checkpoint's directory name


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / META).is_file())


def latest(root: str | Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _records(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "crc32"}} of files in `folder`: the manifest's entries."""
    return {name: {"bytes": (folder / name).stat().st_size, "crc32": _crc32(folder / name)} for name in names}


def _written_here(partial: Path, rank: int) -> dict[str, dict] | None:
    """The manifest entries of the files this rank wrote (DCP names a rank's files __RANK_N.distcp;
    rank 0, the coordinator, also writes .metadata); None if they cannot be read back (rank 0 then
    publishes nothing: every rank still joins the gather, none waits for another)."""
    names = [p.name for p in partial.glob(f"__{rank}_*.distcp")] + ([".metadata"] if rank == 0 else [])
    try:
        return _records(partial, names)
    except OSError:
        return None


def _gathered(entries: dict | None, group=None) -> list[dict | None] | None:
    """Every rank's manifest entries on rank 0 (None elsewhere); collective over `group`."""
    out = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(entries, out, dst=0, group=group)
    return out


def damage(path: str | Path) -> str:
    """What is missing or damaged in checkpoint `path`, in a phrase ("" when every file its manifest
    names is there with its recorded size): a stat per file, no reading (see the module's note).
    A checkpoint written before manifests existed is checked for its meta.json and .metadata."""
    path = Path(path)
    if not path.is_dir():
        return "it does not exist"
    if not (path / META).is_file():
        return f"{META} is missing"
    try:
        files = json.loads((path / META).read_text()).get("files", {".metadata": None})
    except (ValueError, UnicodeDecodeError):
        return f"{META} is not JSON"
    found = []
    for name, record in sorted(files.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            found.append(f"{name} is missing")
            continue
        if record and size != record["bytes"]:
            found.append(f"{name} has {size} bytes, not the {record['bytes']} written")
    return "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")


def step_dirs(root: str | Path) -> list[Path]:
    """Every step-N directory under `root`, oldest first, complete or not."""
    root = Path(root)
    return sorted(p for p in root.glob("step-*") if STEP.fullmatch(p.name)) if root.is_dir() else []


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def newest_intact(root: str | Path, older_than: Path | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint under `root` (older than `older_than`, when given) that `damage` finds
    nothing in, or None; the newer ones it passed over, with their damage). A step-N directory
    without meta.json counts: a save in progress is a hidden .step-N.partial, so one is missing its
    meta.json only by damage."""
    skipped = []
    for path in reversed(step_dirs(root)):
        if older_than is not None and _step(path) >= _step(Path(older_than)):
            continue
        what = damage(path)
        if not what:
            return path, skipped
        skipped.append((path, what))
    return None, skipped


def contents_damage(path: str | Path, group=None) -> str:
    """Collective: what differs in checkpoint `path` from the CRC-32s of its manifest, in a phrase
    ("" when nothing), the same on every rank of `group`, each rank reading 1/world of the files
    (`damage` has checked the sizes)."""
    path = Path(path)
    files = sorted(json.loads((path / META).read_text()).get("files", {}).items())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    found = []  # (name, why) of this rank's share; a file it cannot read is damage too, not a hang of the others
    for name, record in files[rank::world]:
        try:
            if _crc32(path / name) != record["crc32"]:
                found.append((name, ""))
        except OSError as e:
            found.append((name, f"cannot be read: {e.strerror or e}"))
    everyone = [None] * world
    dist.all_gather_object(everyone, found, group=group)
    found = sorted(item for items in everyone for item in items)
    changed = [name for name, why in found if not why]
    phrases = [f"{name} {why}" for name, why in found if why]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        phrases.insert(0, f"the CRC-32 of {', '.join(changed[:3])}{more} is not the one written")
    return "; ".join(phrases)


def local_rectangles(module: nn.Module, opt: AdamW | None, *, model: bool = True,
                     replicas: params.Replicas | None = None) -> list[Rectangle]:
    """The serial rectangles this rank holds: of its parameters ("model/NAME", with `model`) and of
    its ZeRO-1 slices of the optimizer state ("optim/master|m|v/NAME", once it has state). Views of
    the local tensors: nothing is copied or gathered. `replicas`: the ranks holding the same
    parameters (dp*cp; an expert's replicas for its weights); each offers only those assigned to it
    among its replicas (`params.assigned_by_group`), so none plans, stages or sends a chunk DCP would
    drop as another replica's duplicate. The parameters' all-gathers in flight end first."""
    if opt is not None:
        opt.sync.flush()
    layouts = params.layouts(module)
    out = []
    if model:
        owned = params.assigned_by_group([(p.numel(), layout.expert) for p, layout in layouts.items()], replicas)
        for i, (p, layout) in enumerate(layouts.items()):
            if i in owned:
                out += rectangles(layout, p.detach().reshape(-1), prefix="model/")
        for b, layout in params.buffer_layouts(module).items():  # (whole on every rank: DCP writes one copy)
            out += rectangles(layout, b.reshape(-1), prefix="model/")
    if opt is not None and opt.state:
        for bucket, state in zip(opt.sync.buckets, opt.state):
            # each parameter's part of this rank's slice of the bucket
            for p, a, b, at in bucket.segments(*bucket.shard_range(opt.sync.shard)):
                for kind in AdamW.STATE:
                    out += rectangles(layouts[p], state[kind][at : at + b - a], lo=a, prefix=f"optim/{kind}/")
    return out


def _prepare(root: Path, step: int) -> tuple[Path, Path]:
    """(final, partial) directories of checkpoint `step`; the partial one cleared (collective)."""
    final, partial = _step_dir(root, step), root / f".step-{step:08d}.partial"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
    dist.barrier()
    return final, partial


def _publish(root: Path, final: Path, partial: Path, meta: dict, keep: int, files: dict[str, Path],
             written: list[dict]) -> None:
    """Rank 0, once every rank's tensors are written: the extra files and meta.json with the
    manifest (`written`: each rank's entries), the rename to step-N (which makes it a
    checkpoint), and the pruning of older ones."""
    unread = [rank for rank, entries in enumerate(written) if entries is None]
    if unread:
        raise CheckpointError(f"ranks {unread[:8]} could not read back the files they wrote to {partial}; it is not "
                              f"published, and the previous checkpoint is kept")
    for name, source in files.items():
        (partial / name).parent.mkdir(exist_ok=True)  # (a tokenizer's additional_chat_templates/)
        shutil.copyfile(source, partial / name)
    manifest = {name: record for entries in written for name, record in entries.items()}
    manifest.update(_records(partial, list(files)))
    tmp = partial / (META + ".tmp")
    tmp.write_text(json.dumps(dict(meta, files=manifest), indent=1))
    os.replace(tmp, partial / META)
    if final.exists():  # a run resumed from an earlier step reached this one again: the new copy wins
        stale = root / f".{final.name}.replaced"
        os.replace(final, stale)
        os.replace(partial, final)
        shutil.rmtree(stale)
    else:
        os.replace(partial, final)
    # keep the last K up to this step; later ones (from a run this one resumed before) are left alone
    up_to_now = [c for c in complete(root) if c.name <= final.name]
    _prune(root, up_to_now[:-keep] if keep > 0 else [])


PRUNING = "fourfold-prune"  # the background threads' name


def _prune(root: Path, old: list[Path]) -> None:
    """Older checkpoints out of the way at once (renamed: no reader sees them any more), then
    deleted by a background thread, with any an earlier process left half deleted. A large job's
    checkpoint is a file per rank: deleting it here held every rank at the save's last barrier."""
    for checkpoint_dir in old:
        aside = root / f".{checkpoint_dir.name}.pruned"
        shutil.rmtree(aside, ignore_errors=True)  # the same step pruned before, not all deleted then
        os.replace(checkpoint_dir, aside)
    doomed = sorted(root.glob(".step-*.pruned"))
    if doomed:
        threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed], daemon=True,
                         name=PRUNING).start()


def wait_for_pruning() -> None:
    """Until the background deletions of pruned checkpoints are done (at the end of a run)."""
    for thread in threading.enumerate():
        if thread.name == PRUNING:
            thread.join()


def save(root: str | Path, step: int, module: nn.Module, opt: AdamW | None, meta: dict, keep: int,
         files: dict[str, Path] | None = None, replicas: params.Replicas | None = None) -> Path:
    """Write checkpoint `step` (collective: every rank calls it) and return its directory; `files`
    (name -> path, e.g. the tokenizer) are copied in so that the checkpoint stands alone;
    `replicas`: see `local_rectangles`."""
    root = Path(root)
    final, partial = _prepare(root, step)
    try:
        dcp.save({}, checkpoint_id=partial,
                 planner=RectangleSavePlanner(local_rectangles(module, opt, replicas=replicas)))
    except CheckpointException as e:  # raised on every rank when any rank's write failed
        raise _failed_save(root, partial, step, e) from None
    written = _gathered(_written_here(partial, dist.get_rank()))  # (after every rank's write: DCP's last step)
    if dist.get_rank() == 0:
        _publish(root, final, partial, dict(meta, step=step, optimizer_steps=opt.step_count if opt else 0), keep,
                 files or {}, written)
    dist.barrier()
    return final


def _failed_save(root: Path, partial: Path, step: int, error: CheckpointException) -> CheckpointError:
    """The error of a save that some rank could not write (collective: every rank has it), its
    partial directory removed (it would keep a full disk full); the last checkpoint is untouched."""
    dist.barrier()  # every rank's writing has ended
    found = [None]
    if dist.get_rank() == 0:  # one rank walks the directory (every rank's files are there) and removes it
        written = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        full = shutil.disk_usage(root).free == 0
        shutil.rmtree(partial, ignore_errors=True)
        found = [(written, full, shutil.disk_usage(root).free)]
    dist.broadcast_object_list(found, src=0)
    (written, full, free), mib = found[0], 2**20
    reasons = sorted({_write_failure(exc, full) for exc, _ in error.failures.values()})
    return CheckpointError(f"checkpoint step-{step:08d} could not be written in {root}: {'; '.join(reasons)} "
                           f"({written / mib:.1f} MiB written before it failed; its partial files are removed, "
                           f"{free / mib:.1f} MiB free there now) and the last checkpoint is intact: free space "
                           f"there or give another --checkpoint.dir")


def _write_failure(exc: BaseException, full: bool) -> str:
    """What stopped a rank's write, in a few words: a full disk (torch's zip writer says "unexpected
    pos" when a write comes up short), else the error's first line."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "unexpected pos" in str(exc) or full:
        return "the disk is full"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class AsyncSaver:
    """Checkpoints written while training goes on (DCP's async_save).

    A save copies this rank's rectangles into a host buffer (pinned on GPUs; allocated at the first
    save and reused: one rank's share of the model and optimizer state, the staging memory) and
    returns; a background thread writes them, exchanging DCP's plans over a gloo group of its own
    (not the training communicator, which the main thread keeps using). When rank 0's write ends,
    every rank's has (DCP's coordinator gathers their results first), and rank 0 publishes the
    checkpoint there and then (each rank's manifest entries gathered to it over that group first).
    One save is in flight at a time: the next waits for it."""

    def __init__(self) -> None:
        self.group = comm.host_group()  # DCP's coordination: rank 0 and each other
        self.buffer: torch.Tensor | None = None
        self.pending: tuple[Future, Path, Path, int] | None = None  # (the write, root, partial, step)
        self.published = threading.Event()
        self.error: BaseException | None = None

    def staging_bytes(self, rects: list[Rectangle]) -> int:
        return sum(_aligned(r.data.numel() * r.data.element_size()) for r in rects)

    def _stage(self, rects: list[Rectangle]) -> list[Rectangle]:
        size = self.staging_bytes(rects)
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        staged, at = [], 0
        for r in rects:
            n = r.data.numel() * r.data.element_size()
            copy = self.buffer[at : at + n].view(r.data.dtype).view(r.data.shape)
            copy.copy_(r.data.detach(), non_blocking=True)
            staged.append(dataclasses.replace(r, data=copy))
            at += _aligned(n)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are in host memory before training changes the tensors
        return staged

    def save(self, root: str | Path, step: int, module: nn.Module, opt: AdamW | None, meta: dict, keep: int,
             files: dict[str, Path] | None = None, replicas: params.Replicas | None = None) -> Path:
        """Start writing checkpoint `step` (collective) and return its directory-to-be; `replicas`:
        see `local_rectangles` (a replica stages only its share of the model)."""
        self.wait()
        root = Path(root)
        final, partial = _prepare(root, step)
        staged = self._stage(local_rectangles(module, opt, replicas=replicas))
        meta = dict(meta, step=step, optimizer_steps=opt.step_count if opt else 0)
        self.published.clear()
        future = dcp.async_save({}, checkpoint_id=partial, planner=RectangleSavePlanner(staged),
                                process_group=self.group)

        def publish(done: Future) -> None:
            try:  # every rank gathers (a failed write sends None), so that none waits for another forever
                ok = done.exception() is None
                written = _gathered(_written_here(partial, dist.get_rank()) if ok else None, self.group)
                if dist.get_rank() == 0 and ok:  # (a failed write: raised by the next wait())
                    _publish(root, final, partial, meta, keep, files or {}, written)
            except BaseException as e:  # reported by the next wait()
                self.error = e
            finally:
                self.published.set()

        future.add_done_callback(publish)
        self.pending = (future, root, partial, step)
        return final

    def wait(self) -> None:
        """Block until the save in flight is written and published (collective: every rank waits at
        the same point); raise what it failed with: a write some rank could not finish as the
        synchronous save's CheckpointError, its partial directory removed."""
        if self.pending is None:
            return
        (pending, root, partial, step), self.pending = self.pending, None
        try:
            pending.result()
        except CheckpointException as e:  # on every rank, as in `save`
            self.published.wait()
            raise _failed_save(root, partial, step, e) from None
        self.published.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def wait_here(self) -> None:
        """Let the save in flight end, on this rank alone and whatever it ends with: for a run that
        is failing (maybe on this rank only), which must not wait in a collective for the others."""
        if self.pending is not None:
            pending, self.pending = self.pending[0], None
            pending.exception()
            self.published.wait()
            self.error = None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16  # every staged tensor starts at a multiple of any element size


def _shared_rectangles(module: nn.Module, replicas: params.Replicas) -> list[Rectangle]:
    """This rank's 1/n of every local parameter, n the size of its replicas (a contiguous flat range,
    as a ZeRO-1 slice is cut): what it reads when the replicas share a load."""
    rects = []
    for p, layout in params.layouts(module).items():
        lo, hi = _share(p.numel(), replicas.of(layout))
        rects += rectangles(layout, p.detach().reshape(-1)[lo:hi], lo=lo, prefix="model/")
    for b, layout in params.buffer_layouts(module).items():  # (small: every rank reads them whole)
        rects += rectangles(layout, b.reshape(-1), prefix="model/")
    return rects


def _share(numel: int, replicas: comm.Group) -> tuple[int, int]:
    per = -(-numel // replicas.size)
    return min(replicas.rank * per, numel), min((replicas.rank + 1) * per, numel)


def _read_shared(path: Path, module: nn.Module, replicas: params.Replicas) -> None:
    """Each rank reads its share of every local parameter, then the parameter's replicas
    all-gather it whole."""
    _read(path, _shared_rectangles(module, replicas))
    for p, layout in params.layouts(module).items():
        group = replicas.of(layout)
        flat, (lo, hi) = p.detach().reshape(-1), _share(p.numel(), group)
        part = flat.new_zeros(-(-p.numel() // group.size))
        part[: hi - lo] = flat[lo:hi]
        flat.copy_(comm.all_gather(part, group)[: p.numel()])


def dry_run(module: nn.Module, opt: AdamW, replicas: params.Replicas | None = None) -> tuple[dict, dict]:
    """Plan this rank's part of a save and of a same-grid load of it, as `save` and
    `load_checkpoint` do (with the trainer's `replicas`), without files (`fourfold simulate`,
    `memory --measure`): the rectangles offered, the size of the plan DCP's coordinator gathers
    from this rank, and the local views the reads land in (the reads allocate nothing: a memory
    counter running meanwhile shows it; a shared load's all-gather adds a parameter's buffer)."""
    start = time.perf_counter()
    rects = local_rectangles(module, opt, replicas=replicas)
    plan = RectangleSavePlanner(rects).create_local_plan()
    save = dict(seconds=time.perf_counter() - start, chunks=len(plan.items),
                bytes_written=sum(r.data.numel() * r.data.element_size() for r in rects),
                plan_bytes=len(pickle.dumps(plan)))
    start = time.perf_counter()
    # the chunks of this rank's tensors, as its replicas together wrote them: what it reads back
    written = RectangleSavePlanner(local_rectangles(module, opt)).create_local_plan()
    _, metadata = create_default_global_save_plan([written])
    shared = replicas is not None and replicas.shared
    loader = RectangleLoadPlanner(_shared_rectangles(module, replicas) + local_rectangles(module, opt, model=False)
                                  if shared else local_rectangles(module, opt))
    loader.set_up_planner({}, metadata, is_coordinator=True)
    reads = loader.create_local_plan().items
    views = [loader.resolve_tensor(item) for item in reads]
    return save, dict(seconds=time.perf_counter() - start, reads=len(reads),
                      bytes_read=sum(v.numel() * v.element_size() for v in views))


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a step-N directory or a run's checkpoint directory")
    if not (path / META).is_file():
        raise CheckpointError(f"{path} is not a complete fourfold checkpoint (no {META}); give a step-N directory "
                              f"written by `fourfold train`")
    return json.loads((path / META).read_text())


def _read(path: Path, rects: list[Rectangle]) -> None:
    try:
        dcp.load({}, checkpoint_id=str(path), planner=RectangleLoadPlanner(rects))
    except ShardError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except CheckpointException as e:  # raised on every rank for a failure on any
        failures = [error for error, _ in e.failures.values() if isinstance(error, ShardError)]
        if failures:
            raise CheckpointError(f"{path}: {failures[0]}") from None
        raise


def load_checkpoint(path: str | Path, module: nn.Module, opt: AdamW | None = None,
                    replicas: params.Replicas | None = None) -> dict:
    """Set the model (and the optimizer's state, read at its first step, once its buckets are
    traced) from a checkpoint written on any grid: each rank reads only the rectangles it holds,
    into its own tensors; returns the checkpoint's meta. `replicas`: the ranks that hold the same
    model tensors (the trainer's dp*cp; an expert's replicas). Each of them reads 1/n of every tensor
    and they all-gather the rest, so the files are read once per model-parallel part, not once per replica
    (at 405B on 128 replicas: 0.8 TB read instead of 104 TB at every restart)."""
    path = Path(path)
    meta = read_meta(path)
    with torch.no_grad():
        if replicas is None or not replicas.shared:
            _read(path, local_rectangles(module, None))
        else:
            _read_shared(path, module, replicas)
    if opt is not None and meta.get("optimizer_steps"):
        opt.restore(lambda: _read(path, local_rectangles(module, opt, model=False)), meta["optimizer_steps"])
    return meta
