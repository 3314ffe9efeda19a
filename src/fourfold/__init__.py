"""fourfold: 4D hybrid parallel training (dp x pp x cp x 3D tensor) and a planner that picks the grid."""

from fourfold.spec.layout import DEFAULT_ORDER, DIMS, GridError, Layout

__version__ = "0.1.0"

__all__ = ["DEFAULT_ORDER", "DIMS", "Grid", "GridError", "Layout", "__version__"]


def __getattr__(name: str):
    # Grid needs torch.distributed; importing it lazily keeps `import fourfold` (and the planner) light.
    if name == "Grid":
        from fourfold.parallel.grid import Grid

        return Grid
    raise AttributeError(f"module 'fourfold' has no attribute {name!r}")
