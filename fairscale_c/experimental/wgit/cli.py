"""The wgit command line — mirrors fairscale.experimental.wgit.cli: ``init``, ``add [--no_per_tensor]
FILE``, ``commit -m MESSAGE``, ``status``, ``log [-f FILE]``, ``checkout SHA1`` and ``version``,
run in (or under) the repo's directory. An error prints ``fatal: <message>`` and exits with 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from . import version
from .pygit import GitError
from .repo import Repo

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="WeiGit: A git-like tool for model weight tracking")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("version", description="Display version")
    init = sub.add_parser("init", description="Initialize a weigit repo")
    init.add_argument("init", action="store_true", help="initialize the repo")
    status = sub.add_parser("status", description="Shows the repo's current status")
    status.add_argument("status", action="store_true", help="Show the repo's current status")
    add = sub.add_parser("add", description="add a file to the staged changeset (default: none)")
    add.add_argument("add", default="", type=str, metavar="FILE_PATH", help="the file to add")
    add.add_argument("--no_per_tensor", action="store_true", help="Disable per-tensor adding of a file")
    commit = sub.add_parser("commit", description="Commits the staged changes")
    commit.add_argument("commit", action="store_true", help="Commit the staged changes")
    commit.add_argument("-m", "--message", default="", type=str, metavar="MESSAGE", required=True)
    checkout = sub.add_parser("checkout", description="checkout from a commit")
    checkout.add_argument("checkout", default="", type=str, metavar="FILE_SHA1", help="a commit or file version")
    log = sub.add_parser("log", description="Show the history log of the repo or optionally of a file.")
    log.add_argument("log", action="store_true", help="Show the repo's history log")
    log.add_argument("-f", "--file", default="", type=str, metavar="FILE_PATH", help="the file whose log to show")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    """Runs one wgit command (argv: the arguments, default sys.argv[1:])."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "init":
            Repo(Path.cwd(), init=True)
        elif args.command == "add":
            Repo(Path.cwd()).add(args.add, per_tensor=not args.no_per_tensor)
        elif args.command == "status":
            print(Repo(Path.cwd()).status())
        elif args.command == "log":
            Repo(Path.cwd()).log(args.file)
        elif args.command == "commit":
            Repo(Path.cwd()).commit(args.message)
        elif args.command == "checkout":
            Repo(Path.cwd()).checkout(args.checkout)
        elif args.command == "version":
            print(".".join(str(x) for x in version.__version_tuple__))
    except (FileNotFoundError, ValueError, TypeError, GitError) as e:
        sys.stderr.write(f"fatal: {e}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
