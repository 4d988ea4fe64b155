"""Producers of requests: one module per way transformers generates.

* :mod:`.generate_loop`: ``GenerationMixin.generate`` and its decoding loops;
* :mod:`.step_hook`: the per-step hot path of that loop.
"""
