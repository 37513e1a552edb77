"""Evaluation: the eval set, greedy generation with stop rules, scoring, teacher-forced digit metrics, paired
bootstrap metrics, and the reports of `delft eval` (``evaluation.command``).
"""
