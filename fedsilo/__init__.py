"""fedsilo: privacy-hardened cross-silo federated learning.

The code lives in the repository's top-level folders (wire/, policies/, coordinator/, silo/,
ops/), installed as sub-packages of this one; see ARCHITECTURE.md for the import direction.
"""

__version__ = "0.1.0"
