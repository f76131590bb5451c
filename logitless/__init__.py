"""logitless: memory-efficient training ops for large-vocabulary language models.

Front doors: ``logitless.torch`` (PyTorch) and ``logitless.jax`` (JAX). Importing this
package imports neither framework.
"""
__version__ = "0.1.0"
