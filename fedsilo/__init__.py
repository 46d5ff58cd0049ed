"""fedsilo: privacy-hardened cross-silo federated learning.

The code lives in the repository's top-level folders (wire/, policies/, privacy/, models/,
coordinator/, silo/, ops/), installed as sub-packages of this one; see docs/architecture.md for
the map and the import direction.
"""

__version__ = "0.1.0"
