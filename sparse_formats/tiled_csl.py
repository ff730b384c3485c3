"""The `tiled-csl` format."""
