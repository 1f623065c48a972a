"""The RDMA fast path: the pipeline's stages with NIXL as the transport, planned by a controller once.

``schedule`` is a pure function from what trainer ranks hold and what consumers need to who reads what from
whom; it imports neither NIXL nor torch, so it is planned and tested anywhere.
"""
