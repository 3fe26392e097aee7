"""``tile_tokens="auto"``: the token tile of a sequence-tiled block chosen from the free memory, as
the fused loss chooses its vocabulary chunk (remat.autograd.cross_entropy.chunk_size).

Rule (:func:`auto_tile_tokens`): a tile's working set, ``bytes_per_token`` times the tile (each
block states its own: remat.functional's norm_mlp, norm_attention and linear_cross_entropy), may
take min(TILE_BYTES[device type] (2 GiB on a GPU, 256 MiB on the CPU), free memory / 8); the tile
is that many tokens rounded down to a multiple of 256 (at least 256, so the tile's GEMMs stay
large; a multiple of 4 as LoRA dropout needs), and the block runs untiled (0) when the tile would
cover the sequence. On a simulated GPU (remat.estimate) the free memory is unknown and the device's
TILE_BYTES alone decides, so an estimate is reproducible. E.g. Llama-3.1-8B's MLP (intermediate
14336, bf16: 6 x 14336 x 2 bytes per token) gets 12,288-token tiles on a GPU with 16 GiB or more
free.
"""

from remat.autograd.cross_entropy import FREE_MEMORY_FRACTION, free_memory_bytes

AUTO = "auto"
TILE_BYTES = {"cuda": 2 * 2**30, "cpu": 256 * 2**20}
TILE_ALIGN = 256


def auto_tile_tokens(tokens, bytes_per_token, device):
    """The tile (tokens, a multiple of 256) for a block whose tile working set is
    ``bytes_per_token`` per token, over a sequence of ``tokens``, on ``device``; 0 (untiled) when
    the tile would cover the sequence. See the module docstring for the rule."""
    budget = TILE_BYTES.get(device.type, TILE_BYTES["cuda"])
    free = free_memory_bytes(device.type, device.index if device.index is not None else 0)
    if free:
        budget = min(budget, free // FREE_MEMORY_FRACTION)
    tile = max(TILE_ALIGN, budget // max(int(bytes_per_token), 1) // TILE_ALIGN * TILE_ALIGN)
    return 0 if tile >= tokens else int(tile)


def resolve_tile_tokens(tile, tokens, bytes_per_token, device):
    """A checked ``tile_tokens`` (0, an int, or "auto") as the int tile of this call (0: untiled)."""
    if tile == AUTO:
        return auto_tile_tokens(tokens, bytes_per_token, device)
    return tile
