"""``python -m fairscale_c.compat script.py [args...]``: run a script written for FairScale with
``fairscale`` resolving to fairscale_c (see fairscale_c.compat), as ``python script.py`` would:
``sys.argv`` is the script's, ``__name__`` is ``"__main__"`` and the script's folder comes first
on ``sys.path``. ``python -m fairscale_c.compat -m module [args...]`` runs a module instead."""

import os
import runpy
import sys

from . import install

USAGE = "usage: python -m fairscale_c.compat SCRIPT.py [ARGS...]  |  python -m fairscale_c.compat -m MODULE [ARGS...]"


def main(argv: list) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        install()
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"python -m fairscale_c.compat: no such script: {script!r}\n{USAGE}", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    install()
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
