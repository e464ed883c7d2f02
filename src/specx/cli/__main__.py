"""`python -m specx.cli COMMAND`: the same commands as the `specx` script."""

from specx.cli import main

main(prog_name="specx")
