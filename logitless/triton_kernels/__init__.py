"""Triton kernels and their PyTorch glue (autograd, torch.library ops), one module per op."""
