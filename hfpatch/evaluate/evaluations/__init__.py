"""One module per evaluation, named as its command (`hfpatch eval NAME`): it defines EVALUATION, an instance of a
subclass of sweep.Evaluation that owns the evaluation's arguments, generator, scoring, cell axes, tables and plot
(docs/extending.md). The sweep (evaluate/sweep.py) runs it."""
