"""The configuration's schema: typed dataclasses with verl's key names (schema.py) and the generated
key reference (doc.py, ``rlpad config``, docs/configuration.md). The ground floor: imports nothing
else of rlpad. Loading and checking a recipe is :mod:`rlpad.recipe`'s job."""
