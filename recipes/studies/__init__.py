"""Compare studies (recipes/compare.py): small models trained from scratch that differ in one axis, then evaluated —
the study's config and arms (study), what it measures besides the evaluations (measure), its JSON, tables and plot
(report). It sits above both training and the evaluations, so that neither needs the other.
"""
