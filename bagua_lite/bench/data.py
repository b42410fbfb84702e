"""The benchmark's data: synthetic batches for timing."""


def make_batches(shape, batch_size, n_batches, rank, seed=0):
    """Synthetic but learnable data: labels from a fixed random teacher, inputs per rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dim = 1
    for s in shape:
        dim *= s
    teacher = torch.randn(dim, 10, generator=g)
    gr = torch.Generator().manual_seed(seed + 1000 + rank)
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch_size, *shape, generator=gr)
        out.append((x, (x.reshape(batch_size, -1) @ teacher).argmax(1)))
    return out

