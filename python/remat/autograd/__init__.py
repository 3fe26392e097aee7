"""autograd Functions, one file per block; each documents its recompute contract."""
