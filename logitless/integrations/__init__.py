"""Integrations of logitless with other libraries (optional extras).

* :mod:`logitless.integrations.transformers` — Hugging Face causal LMs compute their training
  loss through :func:`logitless.torch.linear_cross_entropy` (``pip install logitless[hf]``).

Importing this package imports no framework; each submodule imports what it integrates with.
"""
