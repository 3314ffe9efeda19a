"""Sharded checkpoints (fourfold.checkpoint.sharded_io): each rank writes and reads only the rectangles it
holds; a checkpoint written on one grid, read on another and written again holds exactly the same
serial tensors (model and ZeRO-1 optimizer state), and no parameter or optimizer state is gathered."""

import pytest
import torch

from fourfold import checkpoint
from fourfold.checkpoint.sharded_io import Rectangle, rectangles
from fourfold.models.config import ModelConfig
from fourfold.parallel import context
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import ParamLayout, Piece, Replicas
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from runs import whole_checkpoint

# awkward sizes: 6 heads over x*y = 4 (the published path), z shards with padding
CFG = ModelConfig("llama", hidden=48, layers=2, heads=6, kv_heads=2, ffn=96, vocab=250, max_positions=64,
                  tied=False, eps=1e-5)


def _model(sizes):
    grid = Grid(Layout(**sizes))
    model = Transformer(grid, CFG, TensorOptions(dtype=torch.float64), seed=3)
    return grid, model, AdamW(GradientSync(model, grid, bucket_mb=0.01), lr=1e-2, weight_decay=0.1)


def _backward(grid, model):
    """One backward on this rank's part of a fixed batch (its dp rows, z part, cp chunks)."""
    ids = torch.randint(0, CFG.vocab, (12, 17), generator=torch.Generator().manual_seed(0))
    mine = ids.chunk(grid.size("dp"))[grid.coords["dp"]].chunk(grid.size("z"))[grid.coords["z"]]
    cp = grid.group("cp")
    model(context.shard_sequence(mine[:, :-1], cp), context.shard_sequence(mine[:, 1:], cp)).sum().backward()


def _train_and_save(sizes, root):
    grid, model, opt = _model(sizes)
    for _ in range(2):
        _backward(grid, model)
        opt.step()
    grid.ledger.reset()
    replicas = Replicas.of_grid(grid)
    checkpoint.save(root, 2, model, opt, {}, keep=1, replicas=replicas)
    # each replica offers only its parameters; together, every one
    offered = {r.name for r in checkpoint.local_rectangles(model, None, replicas=replicas)}
    assert replicas.dense.size == 1 or offered < {r.name for r in checkpoint.local_rectangles(model, None)}
    return grid.ledger.calls()  # fourfold's own collectives during the save


def _load_and_save(sizes, source, root):
    """Loaded the way the trainer loads (the dp*cp replicas each read a part and all-gather);
    returns the model elements this rank read and its share if the replicas split them evenly."""
    grid, model, opt = _model(sizes)
    replicas, read, whole = Replicas.of_grid(grid), [], checkpoint._read
    checkpoint._read = lambda path, rects: read.append(sum(r.data.numel() for r in rects)) or whole(path, rects)
    try:
        checkpoint.load_checkpoint(source, model, opt, replicas=replicas)
    finally:
        checkpoint._read = whole
    _backward(grid, model)
    opt._init_state(opt.sync.finish())  # the optimizer's state is read once its buckets are traced
    checkpoint.save(root, 2, model, opt, {}, keep=1)
    return read[0], sum(-(-p.numel() // replicas.dense.size) for p in model.parameters())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("first, second", [(dict(dp=2, x=2, z=2), dict(y=2, z=3)),
                                           (dict(pp=1, cp=2, y=2, z=2), dict(dp=2, x=2))],
                         ids=["dp2x2z2-to-y2z3", "cp2y2z2-to-dp2x2"])
def test_a_checkpoint_read_on_another_grid_and_written_again_is_the_same(ranks, tmp_path, first, second):
    world = lambda s: Layout(**s).world_size  # noqa: E731
    sent = ranks.run(_train_and_save, world(first), first, tmp_path / "a")
    assert sent == [{}] * world(first)  # no parameter or optimizer state gathered (DCP exchanges only plans)
    a = checkpoint.latest(tmp_path / "a")
    reads = ranks.run(_load_and_save, world(second), second, a, tmp_path / "b")
    assert all(read <= share for read, share in reads)  # each replica read its part of the model only
    original, again = whole_checkpoint(a), whole_checkpoint(checkpoint.latest(tmp_path / "b"))
    assert original.keys() == again.keys() and any(k.startswith("optim/m/") for k in original)
    for key, value in original.items():
        assert not value.isnan().any(), f"{key}: elements no rank wrote"
        assert torch.equal(value, again[key]), key


def test_a_z_piece_is_at_most_three_rectangles():
    # rows 1..4 of an 8 x 5 window at (10, 20) of a [30, 40] tensor: elements 7..23 of the window
    piece = Piece("w", (30, 40), (10, 20), (8, 5), (7, 23), 0)
    flat = torch.arange(16.0)
    rects = rectangles(ParamLayout((), (), (piece,)), flat)
    assert [(r.offsets, r.sizes) for r in rects] == [((11, 22), (1, 3)), ((12, 20), (2, 5)), ((14, 20), (1, 3))]
    assert torch.equal(torch.cat([r.data.reshape(-1) for r in rects]), flat)
    # a ZeRO-1 slice: local elements 5..11 of the same parameter
    part = rectangles(ParamLayout((), (), (piece,)), flat[5:12], lo=5)
    assert [(r.offsets, r.sizes) for r in part] == [((12, 22), (1, 3)), ((13, 20), (1, 4))]
    assert all(isinstance(r, Rectangle) for r in part)


def _saves_after_resuming_from_an_earlier_step(root):
    (root / ".step-00000001.pruned" / "sub").mkdir(parents=True)  # an earlier process's, half deleted
    grid, model, _ = _model({})
    for step in (3, 6):  # a first run
        checkpoint.save(root, step, model, None, {"run": "first"}, keep=2)
    for step in (4, 5, 6):  # resumed from step 3 in the same directory
        checkpoint.save(root, step, model, None, {"run": "second"}, keep=2)
    kept = [(p.name, checkpoint.read_meta(p)["run"]) for p in checkpoint.complete(root)]
    checkpoint.wait_for_pruning()  # it runs in the background
    return kept, sorted(p.name for p in root.iterdir())


def test_a_run_resumed_from_an_earlier_step_replaces_and_prunes_only_up_to_its_step(ranks, tmp_path):
    kept, left = ranks.run(_saves_after_resuming_from_an_earlier_step, 1, tmp_path)[0]
    assert kept == [("step-00000005", "second"), ("step-00000006", "second")]
    assert left == ["step-00000005", "step-00000006"]  # the pruned ones deleted, an earlier process's too


def _train_and_save_async(sizes, root, asynchronous):
    """Save after two steps; with `asynchronous`, the live tensors change while the write is in flight."""
    grid, model, opt = _model(sizes)
    for _ in range(2):
        _backward(grid, model)
        opt.step()
    if asynchronous:
        saver = checkpoint.AsyncSaver()  # as the trainer saves: each dp replica writes its share of the model
        path = saver.save(root, 2, model, opt, {}, keep=1, replicas=Replicas.of_grid(grid))
        with torch.no_grad():  # spoil the live state at once: the staged copy is what gets written
            for t in [*model.parameters(), *(state[kind] for state in opt.state for kind in AdamW.STATE)]:
                t.fill_(float("nan"))
        saver.wait()
    else:
        path = checkpoint.save(root, 2, model, opt, {}, keep=1)
    return str(path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_writes_its_steps_state_while_the_live_tensors_change(ranks, tmp_path):
    sizes = dict(dp=2, y=2)
    sync = ranks.run(_train_and_save_async, 4, sizes, tmp_path / "sync", False)[0]
    background = ranks.run(_train_and_save_async, 4, sizes, tmp_path / "async", True)[0]
    assert checkpoint.latest(tmp_path / "async") == checkpoint.latest(tmp_path / "async").parent / "step-00000002"
    a, b = whole_checkpoint(sync), whole_checkpoint(background)
    assert a.keys() == b.keys() and any(k.startswith("optim/v/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert checkpoint.read_meta(background)["optimizer_steps"] == 2
