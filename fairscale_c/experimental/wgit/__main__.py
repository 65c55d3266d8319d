"""``python -m fairscale_c.experimental.wgit``: the wgit command line."""

from .cli import main

if __name__ == "__main__":
    main()
