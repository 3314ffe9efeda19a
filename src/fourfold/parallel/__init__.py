"""The runtime of each parallel dimension on torch.distributed: the grid and collectives, 3D tensor
parallelism (tensor/), context (ring attention), pipeline, data parallelism with its optimizer, and the
Transformer composed of them."""
