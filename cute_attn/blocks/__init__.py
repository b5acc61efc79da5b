"""Device building blocks shared by the attention kernels (forward now; backward and
decode later): WGMMA helpers, the online softmax, masks, sequence-length info, KV block
ranges, the tile scheduler and the named-barrier registry."""
