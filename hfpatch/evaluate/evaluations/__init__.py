"""One module per evaluation, named as its command (`hfpatch eval NAME`): it defines EVALUATION, an instance of a
subclass of definition.Evaluation that owns the evaluation's arguments, generator, scoring, cell axes, tables and
plot (docs/extending.md). The sweep (evaluate/sweep.py) runs it, and hands each unit the model operations it needs
(run.greedy, run.document_nll): a module here imports no torch, so that its --help answers at once."""
