"""``import fairscale`` in a child process of a program that installed the fairscale alias: the
alias is installed here too, and this module gives its place in sys.modules to it."""

import sys

import fairscale_c.compat

del sys.modules[__name__]
fairscale_c.compat.install()
