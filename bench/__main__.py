"""`python -m bench`: the entry points."""

import bench

print(bench.__doc__)
