"""One module per object store behind the `Backend` protocol; `registry` picks one by URL scheme."""
