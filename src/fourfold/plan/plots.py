"""Planner charts: predicted throughput against memory per GPU, and where the time goes."""

from __future__ import annotations


def plot_candidates(candidates: list[dict], path: str, title: str, top: int = 5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for fits, colour, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "does not fit")):
        pts = [c for c in candidates if c["fits"] == fits]
        if pts:
            left.scatter([c["memory_gib"] for c in pts], [c["tokens_per_second"] for c in pts], s=8, c=colour,
                         label=label)
    # The frontier: the fastest candidate at or below each memory figure, among those that fit.
    frontier, best = [], 0.0
    for c in sorted((c for c in candidates if c["fits"]), key=lambda c: c["memory_gib"]):
        if c["tokens_per_second"] > best:
            best = c["tokens_per_second"]
            frontier.append(c)
    if frontier:
        left.plot([c["memory_gib"] for c in frontier], [c["tokens_per_second"] for c in frontier], "-", c="tab:orange",
                  label="frontier")
        left.axvline(frontier[0]["memory_limit_gib"], ls="--", c="tab:red", label="memory limit")
    chosen = next((c for c in candidates if c["fits"]), None)  # the table's first row: the same ranking
    if chosen:
        left.scatter([chosen["memory_gib"]], [chosen["tokens_per_second"]], s=80, marker="*", c="tab:red",
                     label="chosen")
    left.set_xlabel("memory per GPU (GiB)")
    left.set_ylabel("predicted tokens/s")
    left.set_title(title)
    left.legend()
    shown = [c for c in candidates if c["fits"]][:top]
    bottom = [0.0] * len(shown)
    labels = [_label(c) for c in shown]
    for part in ("compute", "exposed_comm", "bubble", "dp_comm", "optimizer", "tied_embedding"):
        values = [c["time_breakdown_seconds"][part] for c in shown]
        right.bar(range(len(shown)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(shown)), labels, fontsize=7)
    right.set_ylabel("seconds per step")
    right.set_title(f"time breakdown of the top {len(shown)}")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(c: dict) -> str:
    """A candidate's grid on two lines (v only when interleaved, ep only when experts are split)."""
    v = f" v{c['virtual']}" if c.get("virtual", 1) > 1 else ""
    ep = f" ep{c['ep']}" if c.get("ep", 1) > 1 else ""
    return f"dp{c['dp']} pp{c['pp']}{v} cp{c['cp']}\nx{c['x']} y{c['y']} z{c['z']} mb{c['micro_batch']}{ep}"
