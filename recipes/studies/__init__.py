"""Compare studies, the machinery of recipes/compare.py: small models trained from scratch that differ in one axis,
then evaluated — the study's config and arms (study), what it measures besides the evaluations (measure), its JSON,
tables and plot (report). It lives beside its one user, over the package's training and evaluations; compare.py
imports it as `studies` (the script's folder), the tests and eval/docs_tables.py as `recipes.studies` (the
repository root).
"""
