"""Parameter layouts: every rank's local values, placed by their Pieces, rebuild the serial model."""

import pytest
import torch

from fourfold.models.config import load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import full_weights, layouts, load_full
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout

CASES = [
    ("tiny-llama", dict(x=2, y=2, z=2)),
    ("tiny-llama", dict(y=2, z=3)),  # z divides no weight block: the last shards are padded
    ("tiny-gpt", dict(x=2, z=3)),  # tied embedding, biases, learned positions
    ("tiny-gpt", dict(dp=2, x=2, y=2)),
]


def _local_layouts(model_name, sizes):
    """This rank's (layout, flat local values) of each parameter, and the serial weights."""
    grid = Grid(Layout(**sizes))
    model = Transformer(grid, load_config(model_name), TensorOptions(dtype=torch.float64), seed=1)
    # Distinct values everywhere (norms start at ones, biases at zeros), the same on every rank.
    g = torch.Generator().manual_seed(2)
    serial = {name: torch.randn(t.shape, generator=g, dtype=t.dtype) for name, t in sorted(full_weights(model).items())}
    load_full(model, serial)
    local = [(layout, p.detach().reshape(-1).clone()) for p, layout in layouts(model).items()]
    assert len(local) == len(list(model.parameters()))  # each parameter once, the tied weight too
    return local, full_weights(model)


@pytest.mark.parametrize("model_name,sizes", CASES,
                         ids=lambda c: c if isinstance(c, str) else ",".join(f"{k}{v}" for k, v in c.items()))
def test_pieces_rebuild_the_serial_tensors(ranks, model_name, sizes):
    layout = Layout(**sizes)
    results = ranks.run(_local_layouts, layout.world_size, model_name, sizes)
    serial = results[0][1]
    # vectors as [n, 1], as pieces see them; NaN: not written yet
    rebuilt = {name: torch.full((t.shape[0], t[0].numel()), torch.nan, dtype=t.dtype) for name, t in serial.items()}
    copies = {name: torch.zeros(t.shape, dtype=torch.int64) for name, t in rebuilt.items()}
    expected_copies = {}
    for local, _ in results:
        for param_layout, values in local:
            held = torch.zeros(len(values), dtype=torch.bool)
            for piece in param_layout.pieces:
                assert piece.serial_shape == tuple(serial[piece.name].shape)
                (row, col), (_, cols), (lo, hi) = piece.offset, piece.window, piece.flat
                at = slice(piece.local_start, piece.local_start + hi - lo)
                assert not held[at].any()  # pieces never overlap
                held[at] = True
                flat = torch.arange(lo, hi)
                rows, cols = flat // cols + row, flat % cols + col
                before = rebuilt[piece.name][rows, cols]
                written = ~before.isnan()
                assert torch.equal(before[written], values[at][written])  # replicas hold the same values
                rebuilt[piece.name][rows, cols] = values[at]
                copies[piece.name][rows, cols] += 1
                expected_copies[piece.name] = layout.size(("dp", "cp", "pp", *param_layout.replicated))
            assert (values[~held] == 0).all()  # what no piece holds is padding
    assert expected_copies.keys() == serial.keys()
    for name, t in serial.items():
        assert torch.equal(rebuilt[name].view(t.shape), t), name
        assert (copies[name] == expected_copies[name]).all(), name
