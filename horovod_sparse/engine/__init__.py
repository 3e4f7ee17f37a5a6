"""What runs a step of a model's groups the same way under every front end: the step itself
(:mod:`~horovod_sparse.engine.step`), where a group's exchange runs
(:mod:`~horovod_sparse.engine.topology`: the front end's transport, flat or two tiers), a group's
exchange in flight (:mod:`~horovod_sparse.engine.flight`), the two-tier exchange of a group
(:mod:`~horovod_sparse.engine.two_tier`), each group's method state
(:mod:`~horovod_sparse.engine.method_states`) and what is kept of a model between steps
(:mod:`~horovod_sparse.engine.model_state`: checkpoints, agreement, the end of a step). It stands
above the methods and below the front ends.
"""
