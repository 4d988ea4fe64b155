"""Producers of requests: one module per way transformers generates.

The ``generate()`` producer, bottom up: each module imports, at module level, only modules above
it in this list (:mod:`.generate_loop` imports :mod:`.generate_content` inside a function, and only
when content is captured; :mod:`.loop_state` imports :mod:`.step_hook`, which needs transformers,
when a loop's stopping criteria are built):

* :mod:`._routing`: which request and loop a hook records into (the ``_ACTIVE`` context
  variable), and the pure helpers (strategy, model name, returned sequences);
* :mod:`.step_hook`: the per-step hot path of the loop (the recording stopping criteria);
* :mod:`.streamer`: the timing proxy of a ``generate(streamer=...)``;
* :mod:`.loop_state`: :class:`~.loop_state.Call` (one user call) and :class:`~.loop_state.Loop`
  (one decoding loop): their state and small lifecycle, and the protocols of the objects other producers attach;
* :mod:`.accounting`: a call's loops in, its :class:`~otel_generate.request.Request`'s numbers out;
* :mod:`.generate_loop`: ``GenerationMixin.generate``'s hooks and :func:`~.generate_loop.run_request`;
* :mod:`.overrides`: model classes' own ``generate()`` and ``custom_generate``;
* :mod:`.whisper`: Whisper's long-form windows and temperature fallback;
* :mod:`.pipelines`: a running pipeline's tokenizer, for content capture (no span of its own);
* :mod:`.generate_content`: opt-in content (messages, step token ids and log-probabilities) of a
  ``generate()`` request.

Serving paths:

* :mod:`.continuous_batching`: transformers' continuous batching (``generate_batch``, the
  manager API, ``generate(..., cache_implementation="paged")``), one request per submitted request:
  the hooks there, the named records in :mod:`.cb_records`, the per-manager logs in
  :mod:`.cb_manager`, the pure derivation of a ``Request`` in :mod:`.cb_derive`;
* :mod:`.serve`: ``transformers serve``: up to 5.24 its inference thread runs each request in its
  handler's context; from 5.25 each request carries its context (:mod:`._carrier`) from the API
  server to the model's process, which runs it there.
"""
