"""Recipes: the typed schema a YAML recipe is validated into (``schema``), reading recipe and study files within
bounds with their ``base:`` chain and ``--set`` overrides (``files``), and keys as data: flattened, compared and
documented (``keys``). Nothing here imports torch: the CLI and ``delft recipe check`` stay fast."""
