"""memfit's version, the one `memfit --version`, the cache key (memfit.cache) and `memfit.__version__` read
(pyproject.toml [project] version says the same)."""

__version__ = "0.1.0"
