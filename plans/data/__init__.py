"""Prepared datasets, planned: the sample order, packing arithmetic and the index codec (pure)."""
