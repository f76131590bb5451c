"""PyTorch calling the JAX/Pallas port through the DLPack bridge, joining the shared harness."""
