"""A checkpoint's manifest (every file's size and CRC-32, from the rank that wrote it), the check of
the sizes before launch (`checkpoint.damage`, `newest_intact`) and of the contents by the ranks
before they read (`checkpoint.contents_damage`). The trainer's resume past a damaged checkpoint:
tests/train/test_trainer.py."""

import json
import zlib

import pytest

from fourfold import checkpoint
from fourfold.models.config import load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout


def _save(root, notes, background):
    model = Transformer(Grid(Layout(x=2)), load_config("tiny-llama"))
    if background:
        saver = checkpoint.AsyncSaver()
        saver.save(root, 1, model, None, {}, keep=1, files={"notes.txt": notes})
        saver.wait()
    else:
        checkpoint.save(root, 1, model, None, {}, keep=1, files={"notes.txt": notes})


def _verify(path):
    return checkpoint.contents_damage(path)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_the_manifest_records_every_file_of_the_checkpoint(ranks, tmp_path, background):
    notes = tmp_path / "notes.txt"
    notes.write_text("copied in")
    ranks.run(_save, 2, tmp_path / "run", notes, background)
    step = checkpoint.latest(tmp_path / "run")
    files = checkpoint.read_meta(step)["files"]
    assert set(files) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "notes.txt"}
    assert set(files) == {p.name for p in step.iterdir()} - {checkpoint.META}
    for name, record in files.items():
        data = (step / name).read_bytes()
        assert record == {"bytes": len(data), "crc32": zlib.crc32(data)}, name
    assert checkpoint.damage(step) == ""


def test_a_changed_byte_is_found_by_the_ranks_before_any_reads(ranks, tmp_path):
    """The sizes are right (the check before launch finds nothing); the CRC-32, which the ranks
    check together, is not."""
    notes = tmp_path / "notes.txt"
    notes.write_text("copied in")
    ranks.run(_save, 2, tmp_path / "run", notes, False)
    step = checkpoint.latest(tmp_path / "run")
    assert ranks.run(_verify, 2, step) == ["", ""]
    _flip_a_byte(step / "__1_0.distcp")
    assert checkpoint.damage(step) == ""
    assert ranks.run(_verify, 2, step) == ["the CRC-32 of __1_0.distcp is not the one written"] * 2
    (step / "__0_0.distcp").unlink()
    (step / "__0_0.distcp").mkdir()  # a file no rank can read: damage, reported by the rank that tried
    assert ranks.run(_verify, 2, step) == ["the CRC-32 of __1_0.distcp is not the one written; __0_0.distcp cannot "
                                           "be read: Is a directory"] * 2


def _source(run_dir, *options):
    from fourfold.config import load_train_config
    from fourfold.train.resume import agreed_source

    return agreed_source(load_train_config(None, ["--log.run_dir", str(run_dir), *options]), None)


def _save_steps(root, steps):
    model = Transformer(Grid(Layout(x=2)), load_config("tiny-llama"))
    for step in steps:
        checkpoint.save(root, step, model, None, {}, keep=len(steps))


def test_a_resume_passes_over_its_own_checkpoint_whose_bytes_changed(ranks, tmp_path):
    """Sizes right, contents not: the ranks find it together and take the next older intact
    checkpoint of the run's own, saying why (as for a missing file); with none left, they stop
    naming every damage."""
    root = tmp_path / "run" / "checkpoints"
    ranks.run(_save_steps, 2, root, [1, 2, 3])
    newest, middle, oldest = reversed(checkpoint.step_dirs(root))
    _flip_a_byte(newest / "__1_0.distcp")
    (middle / "__0_0.distcp").unlink()  # passed over by the sizes
    crc = "the CRC-32 of __1_0.distcp is not the one written"
    expected = (oldest, [(newest, crc), (middle, "__0_0.distcp is missing")])
    assert ranks.run(_source, 2, tmp_path / "run") == [expected, expected]
    # another run's checkpoint.load of it: refused, naming the files (there is no other one to take)
    with pytest.raises(AssertionError, match=f"checkpoint.load: the checkpoint .*step-00000003 is damaged \\({crc}\\): "
                                             "copy it again"):
        ranks.run(_source, 2, tmp_path / "other", "--checkpoint.load", str(newest))
    with pytest.raises(AssertionError, match="checkpoint.load: the checkpoint .*step-00000003 is damaged"):  # also
        # the run's own, named by checkpoint.load with resume off: what was asked for, not an older one
        ranks.run(_source, 2, tmp_path / "run", "--checkpoint.resume", "false", "--checkpoint.load", str(newest))
    _flip_a_byte(oldest / ".metadata")
    with pytest.raises(AssertionError, match=f"every checkpoint in .* is damaged \\(step-00000003: {crc}; "
                                             "step-00000002: __0_0.distcp is missing; step-00000001: the CRC-32 of "
                                             ".metadata is not the one written\\): move them aside"):
        ranks.run(_source, 2, tmp_path / "run")


def test_newest_intact_passes_over_damaged_checkpoints_and_says_why(tmp_path):
    def step(n, meta):
        path = tmp_path / f"step-{n:08d}"
        path.mkdir()
        (path / "a.distcp").write_bytes(b"12345")
        if meta is not None:
            (path / checkpoint.META).write_text(meta)
        return path

    intact = step(1, json.dumps({"files": {"a.distcp": {"bytes": 5, "crc32": 0}}}))
    short = step(2, json.dumps({"files": {"a.distcp": {"bytes": 9, "crc32": 0}, "b.distcp": {"bytes": 1, "crc32": 0}}}))
    no_meta = step(3, None)
    broken = step(4, "{")
    (tmp_path / ".step-00000005.partial").mkdir()  # a save in progress is none
    assert checkpoint.newest_intact(tmp_path) == (intact, [
        (broken, "meta.json is not JSON"),
        (no_meta, "meta.json is missing"),
        (short, "a.distcp has 5 bytes, not the 9 written; b.distcp is missing")])
    assert checkpoint.damage(tmp_path / "step-00000009") == "it does not exist"
    assert checkpoint.newest_intact(tmp_path / "none") == (None, [])
