"""The `specx` command line: one module per command group, each command a thin layer.

Commands parse and check their options, call the library and print; see `common` for
the error handling every command shares.
"""

from __future__ import annotations

import logging

import click

from specx import __version__
from specx.cli import build, calibrate, export, generate
from specx.cli.common import SpecxGroup

__all__ = ["main"]


class _LevelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


@click.group(cls=SpecxGroup)
@click.version_option(__version__, prog_name="specx")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details to stderr.")
def main(verbose: bool) -> None:
    """Compile lossless speculative decoding: HF checkpoint -> ONNX artifact -> runtime."""
    handler = logging.StreamHandler()
    handler.setFormatter(_LevelFormatter())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])


for _module in (export, generate, calibrate, build):
    for _command in _module.COMMANDS:
        main.add_command(_command)
