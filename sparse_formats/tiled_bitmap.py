"""The `tiled-bitmap` format."""
