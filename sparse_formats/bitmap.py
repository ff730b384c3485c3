"""The `bitmap` format."""
