"""`delft inspect`: per-digit probability tables and a heatmap for one prompt's answer, for one or several models.
"""
