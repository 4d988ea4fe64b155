"""Producers of requests: one module per way transformers generates.

* :mod:`.generate_loop`: ``GenerationMixin.generate`` and its decoding loops;
* :mod:`.step_hook`: the per-step hot path of that loop;
* :mod:`.generate_content`: opt-in content (messages, step token ids and log-probabilities) of a
  ``generate()`` request;
* :mod:`.pipelines`: a running pipeline's tokenizer, for content capture (no span of its own);
* :mod:`.continuous_batching`: transformers' continuous batching (``generate_batch``, the
  manager API, ``generate(..., cache_implementation="paged")``), one request per submitted request:
  the hooks there, the named records in :mod:`.cb_records`, the per-manager logs in
  :mod:`.cb_manager`, the pure derivation of a ``Request`` in :mod:`.cb_derive`;
* :mod:`.serve`: ``transformers serve``'s inference thread runs each request in its handler's context.
"""
