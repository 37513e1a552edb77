"""Experiments: `delft compare` (train what is missing, evaluate side by side) and `delft study` (recipes x seeds x
eval sets, paired intervals per seed and pooled), with their markdown summaries.
"""
