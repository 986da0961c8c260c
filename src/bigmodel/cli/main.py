"""Entry point of the ``bigmodel`` console script.

Results go to stdout, logs and progress to stderr.  Bad input (missing folder or config,
unknown dtype, budgets too small for even one layer, no tokenizer...) ends with a
one-line ``bigmodel: error: ...`` naming the problem and the fix, and exit status 2;
``BIGMODEL_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from .generate_cmd import add_generate_parser
from .inspect_cmds import add_estimate_parser, add_plan_parser

# Bad input: a missing or unreadable path, a folder that cannot be written, a value out of range.
USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one ``bigmodel: error: ...`` line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as the CLI's one error line (naming ``--help`` for the fix) and exit 2."""
        self.exit(2, f"bigmodel: error: {_one_line(message)}; see `{self.prog} --help`.\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with the ``generate``, ``estimate`` and ``plan`` subcommands."""
    parser = _Parser(
        prog="bigmodel",
        description="Run PyTorch models larger than the memory of any one device.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="{generate,estimate,plan}")
    add_generate_parser(subparsers)
    add_estimate_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bigmodel").setLevel(logging.INFO if verbosity == 0 else level)
    if verbosity == 0:  # optional kernels torchao cannot load on this build, pytree notices: not the user's concern
        for noisy in ("torchao", "torch.utils._pytree"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a check failed, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        print("bigmodel: error: no command given; run `bigmodel generate`, `bigmodel estimate MODEL` or "
              "`bigmodel plan MODEL`.", file=sys.stderr)  # fmt: skip
        return 2
    _setup_logging(args.verbose)
    try:
        return args.run(args)
    except USAGE_ERRORS as error:
        if os.environ.get("BIGMODEL_DEBUG"):
            raise
        print(f"bigmodel: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `bigmodel plan --json | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("bigmodel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
