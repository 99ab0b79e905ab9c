"""Paged attention backends behind one protocol.

``base``: the protocol (``AttentionBackend``) and the step records every backend reads;
``torch_backend``: plain torch, any device (the reference); ``native``: the CPU fp32 C decode
kernel; ``triton_backend``: one Triton paged kernel for the whole flat batch (CUDA; the CPU under
``TRITON_INTERPRET=1``); ``select``: ``select_backend``, which maps
``ModelConfig.attention_backend`` to one.
Import from the modules themselves: this package imports nothing, so the model code's import of
``base`` does not load every backend.
"""
