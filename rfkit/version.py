"""rfkit's version, in a module of its own so that any layer can read it without importing the
package's ``__init__`` (which registers the model classes and would close an import circle)."""

__version__ = "0.1.0"
