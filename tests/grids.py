"""Grid shapes the tests share."""

from fourfold.spec.layout import DEFAULT_ORDER, DIMS, factorisations

ALL_8 = [dict(zip(DIMS, f)) for f in factorisations(8)]  # every factorisation of 8 ranks over the six dims
ORDERS = [DEFAULT_ORDER, ("pp", "dp", "cp", "z", "y", "x"), ("z", "x", "cp", "y", "pp", "dp")]
