"""The `localinfer` command: the Typer app, its commands (one module per group), and `main`, which
turns every failure into one line on stderr and a documented exit code.

Only the cli package knows the terminal, stdin and exit codes; the layers below report through
the callbacks it hands them (docs/architecture.md).
"""

from __future__ import annotations

import io
import os
import sys
import traceback

import typer

from localinfer import settings
from localinfer.cli import (batch, cache, console, embed, generate, launch, measure, models,
                            serve, server_client, shell, show, worker)
from localinfer.cli import help_style
from localinfer.cli.options import misread_think
from localinfer.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, LocalinferError

help_style.apply()

# typer >= 0.22 parses with its own copy of click (typer._click): its exceptions are not click's,
# and it no longer imports click at all (so neither do we: a hundredth of a second).
try:
    from typer._click.exceptions import NoArgsIsHelpError, UsageError as _ClickUsageError
    _CLICK_EXIT: tuple[type[BaseException], ...] = (typer.Exit,)
    _CLICK_ABORT: tuple[type[BaseException], ...] = (typer.Abort,)
except ImportError:
    import click
    from click.exceptions import NoArgsIsHelpError, UsageError as _ClickUsageError
    _CLICK_EXIT = (click.exceptions.Exit, typer.Exit)
    _CLICK_ABORT = (click.exceptions.Abort, typer.Abort)

app = typer.Typer(
    help="Run language models locally, as fast as the hardware allows.",
    no_args_is_help=True, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# click's shell completion: the script `--install-completion` writes calls us back with this set.
COMPLETE_VAR = "_LOCALINFER_COMPLETE"


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"localinfer {_version('localinfer')} "
                         f"(llama-cpp-python {_version('llama-cpp-python')})\n")
        raise typer.Exit()


def _version(package: str) -> str:
    from importlib import metadata     # not importing llama_cpp: --version stays instant
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors, and the "
                               "engine's log."),
    version: bool = typer.Option(False, "--version", "-V", callback=_show_version,
                                 is_eager=True, help="Print the version and exit."),
) -> None:
    """Run language models locally, as fast as the hardware allows.

    \b
    localinfer run smollm2 "Why is the sky blue?"
    git diff | localinfer run qwen2.5-1.5b "Write a commit message." -n 60
    localinfer chat smollm2
    """


# In the order `localinfer --help` lists them.
generate.register(app)
batch.register(app)
embed.register(app)
serve.register(app)
server_client.register(app)
launch.register(app)
worker.register(app)
models.register(app)
show.register(app)
measure.register(app)
app.add_typer(cache.app, name="cache")


# -- entry point ----------------------------------------------------------------------------------
def optional_think_value(args: list[str]) -> list[str]:
    """`--think` alone means `--think on` (click has no option whose value may be left out):
    the value is put in where the next argument is not one. Arguments after `--` stay as they are."""
    from localinfer.thinking.style import THINK_VALUES
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        out.append(arg)
        if arg == "--think" and (i + 1 == len(args) or args[i + 1] not in THINK_VALUES):
            out.append("on")
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every failure ends as one line on stderr and a documented exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    # --debug is ours anywhere but after `--`, where the arguments are a prompt's or an agent's
    ours = args.index("--") if "--" in args else len(args)
    console.set_debugging("--debug" in args[:ours])
    typed = [a for a in args[:ours] if a != "--debug"] + args[ours:]
    args = optional_think_value(typed)
    if COMPLETE_VAR in os.environ:   # a shell asking for completions: click's own protocol
        typer.main.get_command(app).main(args, prog_name="localinfer", complete_var=COMPLETE_VAR)
    shell.guard_standard_streams()
    shell.redeliver_lost_interrupts()
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")
    try:
        console.set_debugging(console.debugging() or settings.load().debug)
        shell.check_arguments(args)
        code = _invoke(args or ["--help"])   # bare `localinfer`: the help, and a normal end
    except NoArgsIsHelpError as e:   # `localinfer run` with nothing to run: the help, exit 2
        e.show()
        sys.exit(EXIT_USAGE)
    except _ClickUsageError as e:
        _fail(misread_think(typed, e.format_message()) or e.format_message(), EXIT_USAGE, e)
    except (KeyboardInterrupt, *_CLICK_ABORT):
        _flush_quietly()
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        shell.quiet_broken_pipe()
        sys.exit(0)
    except LocalinferError as e:
        _fail(str(e), e.exit_code, e)
    except OSError as e:             # the disk or the file system, not a bug: say which file
        _fail(_os_error_line(e), EXIT_RUNTIME, e)
    except MemoryError as e:
        _fail("out of memory; try a smaller model, --ctx or --memory", EXIT_RUNTIME, e)
    except Exception as e:  # a bug: still one line, the traceback with --debug
        _fail(f"internal error: {type(e).__name__}: {e} (run with --debug for details)",
              EXIT_RUNTIME, e)
    sys.exit(code if isinstance(code, int) else 0)


def _invoke(args: list[str]) -> object:
    """Parse the arguments and run the command. Not through click's main(): that turns a closed
    pipe into a silent exit 1 before any handler here could call it the normal end it is."""
    command = typer.main.get_command(app)
    try:
        # config.toml's [defaults] as click's defaults: checked by each option's own type
        with command.make_context("localinfer", args,
                                  default_map=_config_defaults(command, args)) as ctx:
            return command.invoke(ctx)
    except _CLICK_EXIT as e:
        return e.exit_code
    except _ClickUsageError as e:
        if _has_config():
            from localinfer.cli import defaults
            defaults.blame(e)   # a value from config.toml: the line names the file
        raise


def _has_config() -> bool:
    conf = settings.load()
    return conf.user_config.exists() or conf.user_catalogue.exists()


def _config_defaults(command, args: list[str]):
    """config.toml's defaults (and the user catalogue's stray keys warned about); without either
    file nothing is read, and TOML is not even imported: start-up stays as it was."""
    if not _has_config():
        return None
    from localinfer.cli import defaults
    return defaults.default_map(command, args)


def _fail(message: str, code: int, exc: BaseException) -> None:
    if console.debugging():
        traceback.print_exception(exc, file=sys.stderr)
    # The first of the lines a multi-line message of ours has; any other control character
    # (outside text quoted in the message) is escaped by console.error, not cut at.
    console.error(message.split("\n")[0] if message else type(exc).__name__)
    sys.exit(code)


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except (OSError, LocalinferError):   # a closed pipe or stdout: nothing more to say
        pass


def _os_error_line(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or type(e).__name__}{where}"
