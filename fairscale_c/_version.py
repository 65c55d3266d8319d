"""The package's one version string.

pyproject.toml takes the distribution's version from here (read statically, without importing the
package), setup.py compiles it into the extension (``build_info()["version"]``), and
``fairscale_c.__version__`` re-exports it. Change it here only.
"""

__version__ = "0.1.0"
