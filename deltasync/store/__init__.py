"""Storing: a stream's layout on any store URL, and everything a ``Store`` is made of.

What lives here:

- ``stream``: the :class:`Store` (a step-addressed stream on any store URL: layout, create-only commit, the
  ``latest.json`` hint, catch-up entries) and ``open_store``;
- ``objects``: a stream's objects (step directories, manifests, checked downloads): ``StoreObjects``, a part of
  the ``Store``;
- ``lease``: the writer lease (one publisher per stream): ``WriterLease``, a part of the ``Store``;
- ``retries``: retrying a store's transient failures, and what a failure says: ``Retrier``, a part of the ``Store``;
- ``node_cache``: the host's shared download cache;
- ``scratch``: scratch space (downloads kept while open, files written before upload);
- ``location``: a store as one value (``StoreLocation``: URL + options, secrets that never print);
- ``model_files``: the model's own files (config, tokenizer) kept beside the stream.

A ``Store`` is composed of its parts: each is given what it needs when it is made and none reads another's private
fields; the store's public methods (``fetch_object``, ``call``, ``acquire_lease``...) delegate to them.

The other half, following a stream (reading it, watching for steps), is ``deltasync.follow``. This module
re-exports the names other modules import from ``deltasync.store``; the rest is imported from its own module.
"""

from deltasync.store.stream import (
    LATEST,
    MANIFEST,
    CatchupEntry,
    Manifest,
    Part,
    Store,
    catchup_dir,
    open_store,
    sha256_file,
    step_dir,
)

__all__ = ["LATEST", "MANIFEST", "CatchupEntry", "Manifest", "Part", "Store", "catchup_dir", "open_store",
           "sha256_file", "step_dir"]
