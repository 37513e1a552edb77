"""Planning a run before it starts: a model's shape from its config.json alone (``shapes``), the peak GPU memory
of delft's training step (``memory``), the settings that bring an oversized run within a budget (``knobs``), and
``delft recipe check --plan`` that prints them (``command``). Nothing here imports torch or loads weights."""
