"""The folder of ``fairscale.py``, the module that child processes import as ``fairscale``.

:func:`fairscale_c.compat.install` puts this folder (not this package) on ``PYTHONPATH``, so that
Python processes started by the program (``multiprocessing`` / ``torch.multiprocessing.spawn``
workers, ``subprocess``) resolve ``import fairscale`` to fairscale_c as the program does."""
