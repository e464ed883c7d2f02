"""The `specx` command line: one module per command group, each command a thin layer.

Commands parse and check their options, call the library and print; see `common` for
the error handling every command shares.
"""

from __future__ import annotations

import logging

import click

from specx import __version__
from specx.cli import build, calibrate, export, generate, serve, train
from specx.cli.common import SpecxGroup

__all__ = ["main"]


class _StderrHandler(logging.Handler):
    """specx's log records as `warning: ...` lines on the current stderr (click's)."""

    def emit(self, record: logging.LogRecord) -> None:  # noqa: D102
        click.echo(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


@click.group(cls=SpecxGroup)
@click.version_option(__version__, prog_name="specx")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details to stderr.")
def main(verbose: bool) -> None:
    """Compile lossless speculative decoding: HF checkpoint -> ONNX artifact -> runtime."""
    logger = logging.getLogger("specx")
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.propagate = False


for _module in (export, train, generate, calibrate, build, serve):
    for _command in _module.COMMANDS:
        main.add_command(_command)
