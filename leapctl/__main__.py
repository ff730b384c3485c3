"""`python -m leapctl ...` (and `torchrun -m leapctl learn ...`) run the CLI."""

from leapctl.cli import main

main()
