"""The storage layer: bytes and commits, torch-free and Ray-free.

It sits between `plans` (pure) and `actors` (a rank's work): a driver that only looks at a store,
the catalog, and any training loop (torchrun, Ray Train) reach checkpoints through it without
importing torch or Ray. What differs between object stores lives behind one protocol,
`backends.protocol.Backend`, chosen by URL scheme in `backends.registry`; the rest (manifests,
checksums, ranged reads, partial-read verification, upload options) is written once for all.
"""
