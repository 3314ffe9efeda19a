"""Jobs the rules accept on up to 8 ranks, for the rules' tests and the steps they train."""

from fourfold.models.config import ModelConfig, load_config
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout, factorisations
from fourfold.spec.rules import problems

MODELS = {
    "tiny-llama": load_config("tiny-llama"),  # hidden 128, 8 heads, 4 kv heads, ffn 352, 2 layers
    "tiny-gpt": load_config("tiny-gpt"),  # tied: the last pipeline stage holds a copy of the embedding
    # awkward sizes: 6 heads, 2 kv heads, ffn 96, an odd vocabulary, 3 layers
    "odd-llama": ModelConfig("llama", hidden=48, layers=3, heads=6, kv_heads=2, ffn=96, vocab=250, max_positions=64,
                             tied=False, eps=1e-5),
}
FIXES = ("choose ", "use ", "set ", "raise ", "give ", "change ", "turn ")


def _jobs(world: int):
    """Every grid of `world` ranks, each with one of two option sets (alternating)."""
    for i, sizes in enumerate(factorisations(world)):
        layout = Layout(**dict(zip(("dp", "pp", "cp", "x", "y", "z"), sizes)))
        if i % 2:
            yield Job(layout, micro_batch=2, global_batch=4 * layout.dp, seq=24, seq_parallel=True,
                      recompute="selective", schedule="gpipe", precision="float64")
        else:
            yield Job(layout, micro_batch=4, global_batch=8 * layout.dp, seq=16, recompute="full", precision="float64")


def accepted_jobs():
    out, refused = [], 0
    for name, model in MODELS.items():
        for world in range(1, 9):
            for job in _jobs(world):
                found = problems(model, job, world=world)
                for p in found:
                    assert p.fix.startswith(FIXES), p  # every refusal says what to change
                refused += bool(found)
                if not found:
                    out.append((name, job))
    return out, refused
