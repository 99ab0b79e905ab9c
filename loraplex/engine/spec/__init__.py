"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in the
step that decodes the request, with each row's own adapter.

* ``proposer.py``: the ``Proposer`` protocol; ``ngram.py`` (prompt lookup) and
  ``draft_model.py`` (a smaller model, no adapters, its own paged KV) implement it;
* ``policy.py``: how many drafts each request gets (its acceptance rate) and when a step
  speculates at all (the number of decoding requests);
* ``engine/rejection_sampler.py`` (beside the runner, which calls it): verification;
* ``decoder.py``: the component the engine core calls after each step, with its counters.

The scheduler sees drafts only as ``Request.draft_token_ids`` and trims rejected ones through
its ``rollback`` (the path a grammar rollback takes).
"""
