"""python -m shardformer COMMAND ...

Commands:
  verify   compare a checkpoint sharded over local ranks with the unsharded
           model, module by module (shardformer.verification.cli, docs/verify.md)
"""
from __future__ import annotations

import sys


def _verify(argv: list[str]) -> int:
    from .verification.cli import main

    return main(argv)


COMMANDS = {"verify": _verify}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"python -m shardformer: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
