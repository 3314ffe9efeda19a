"""How a mixture's experts were loaded in a step, from each layer's routing counts on every rank
(`Model.expert_load`, summed over the grid in the window's read): tokens per expert (min, mean,
max), the imbalance (max / mean: 1 is perfect balance), the choices dropped over the capacity
factor, and the router's mean entropy (nats; log(experts) is a uniform router, 0 a collapsed one)."""

from __future__ import annotations


def layer_figures(row: list[float], top_k: int) -> dict[str, float] | None:
    """One layer's figures from its summed row [choices per expert..., dropped, entropy sum]; None
    for a layer no token was routed through (a dense layer of the model)."""
    counts, dropped, entropy = row[:-2], row[-2], row[-1]
    choices = sum(counts) + dropped
    if not choices:
        return None
    mean = sum(counts) / len(counts)
    return dict(min=min(counts), mean=mean, max=max(counts), imbalance=max(counts) / mean if mean else 0.0,
                dropped=dropped, entropy=entropy / (choices / top_k))


def step_figures(rows: list[list[float]], top_k: int) -> dict[str, dict[str, float]]:
    """{"layer{i}": figures} of the mixture layers of one step."""
    out = {}
    for i, row in enumerate(rows):
        figures = layer_figures(row, top_k)
        if figures is not None:
            out[f"layer{i}"] = figures
    return out
