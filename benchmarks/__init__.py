"""Microbenchmarks of remat's blocks against stock PyTorch (`make bench`)."""
