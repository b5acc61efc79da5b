"""Device building blocks shared by every kernel family (forward, backward and its pre-
and postprocess; decode, FP8 and masks to come): the tile scheduler, sequence-length
info, KV / query block ranges, masks, mask and score mods, dropout (Philox), the online
softmax with score scaling and sinks, TMA
pipelines, WGMMA helpers, epilogue stores, global-memory views, the dQ accumulator
layout, bulk copies, semaphores and the named-barrier registry. kernels/__init__.py maps
which kernel uses which."""
