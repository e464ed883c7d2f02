"""What every command shares: the error-handling group, checked option types, the extras check.

Every failure a user can cause ends as ONE line on stderr, `error: ...`, with exit code 2
(bad input) or 1 (the system refused, e.g. a permission): specx's own errors, click's
usage errors, a missing optional dependency (named with the extra that brings it), and
OS errors (which name the file).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import click
from click.core import ParameterSource

from specx.errors import SpecxError

__all__ = [
    "NATURAL",
    "POSITIVE",
    "FiniteFloat",
    "IntRange",
    "SpecxGroup",
    "only_applies",
    "passed",
    "progress",
    "require_extra",
    "CHAT_TEMPLATE_HELP",
    "warn",
]


class IntRange(click.IntRange):
    """click's IntRange, named "integer" in messages ("'1.5' is not a valid integer")."""

    name = "integer"


CHAT_TEMPLATE_HELP = (
    "Jinja chat template for /v1/chat/completions and Engine.chat: a .jinja file, or a .json "
    "holding chat_template (and bos_token / eos_token) like tokenizer_config.json"
)

POSITIVE = IntRange(min=1)
NATURAL = IntRange(min=0)

# Top-level modules of the optional extras (pyproject.toml), for "install this" messages.
EXTRA_MODULES = {
    "export": ("torch", "onnx", "onnxscript", "onnx_ir", "transformers", "safetensors"),
    "gpu": ("tensorrt", "triton", "polygraphy"),
    "serve": ("fastapi", "uvicorn"),
    "ray": ("ray",),
}


def progress(message: str) -> None:
    """A progress line on stderr (stdout stays for results)."""
    click.echo(message, err=True)


def warn(message: str) -> None:
    """A warning on stderr: something the user asked for is done differently."""
    click.echo(f"warning: {message}", err=True)


class FiniteFloat(click.FloatRange):
    """A float in a range that is also finite: click's FloatRange lets `nan` through."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):  # noqa: D102
        result = super().convert(value, param, ctx)
        if not math.isfinite(result):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return result


def passed(ctx: click.Context, *names: str) -> list[str]:
    """The options among `names` (parameter names) that the command line set explicitly."""
    flags = {p.name: "/".join([p.opts[-1], *p.secondary_opts[-1:]]) for p in ctx.command.params}
    return [
        flags[name]
        for name in names
        if ctx.get_parameter_source(name)
        in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]


def only_applies(flags: list[str], where: str) -> str:
    """'--a applies only to X' / '--a, --b apply only to X'."""
    verb = "applies" if len(flags) == 1 else "apply"
    return f"{', '.join(flags)} {verb} only to {where}"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def require_extra(command: str, extra: str = "export") -> None:
    """Refuses `command` before it starts when a module of `extra` is not installed.

    Raises:
        SpecxError: naming the command, the missing modules and the pip command.
    """
    missing = [m for m in EXTRA_MODULES[extra] if not _installed(m)]
    if missing:
        raise SpecxError(
            f"specx {command} needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"pip install 'specx[{extra}]'"
        )


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _missing_module_message(ctx: click.Context, error: ModuleNotFoundError) -> str | None:
    top = (error.name or "").partition(".")[0]
    for extra, modules in EXTRA_MODULES.items():
        if top in modules:
            command = ctx.invoked_subcommand or ctx.info_name
            return (
                f"specx {command} needs the '{extra}' extra ({top} is not installed): "
                f"pip install 'specx[{extra}]'"
            )
    return None


class SpecxGroup(click.Group):
    """Turns every user-caused failure into one `error:` line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:  # noqa: D102
        try:
            return super().invoke(ctx)
        except SpecxError as e:
            self._fail(ctx, str(e), 2)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            self._fail(ctx, e.format_message() + where, e.exit_code)
        except click.ClickException as e:
            self._fail(ctx, e.format_message(), e.exit_code)
        except ModuleNotFoundError as e:
            message = _missing_module_message(ctx, e)
            if message is None:
                raise
            self._fail(ctx, message, 2)
        except OSError as e:
            self._fail(ctx, str(e), 1)

    @staticmethod
    def _fail(ctx: click.Context, message: str, code: int) -> None:
        click.echo(f"error: {_one_line(message)}", err=True)
        ctx.exit(code)


BUILD_HELP = (
    "The artifact's build to run, e.g. ort-fp32, ort-int4, or 'exported' for the exported "
    "graphs [default: the artifact's default build, the newest built]."
)
