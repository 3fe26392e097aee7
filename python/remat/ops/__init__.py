"""Operator registration: the extension's ops' fake kernels, the Triton launchers as custom ops,
and the plain-PyTorch implementations, one file per block."""
