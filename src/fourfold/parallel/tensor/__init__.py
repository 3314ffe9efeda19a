"""3D tensor parallelism over the (x, y, z) dims of a Grid."""
