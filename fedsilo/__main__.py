"""`python -m fedsilo` runs the command-line interface."""

from fedsilo.ops.cli import main

main()
