"""The `csr` format."""
