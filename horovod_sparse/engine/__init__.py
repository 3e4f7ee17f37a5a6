"""What runs a step of a model's groups the same way under every front end: the state kept of a
model between steps (:mod:`~horovod_sparse.engine.model_state`), the driving of one group's
exchange (:mod:`~horovod_sparse.engine.flight`), the two-tier exchange of a group
(:mod:`~horovod_sparse.engine.two_tier`) and the two tiers' Horovod process sets
(:mod:`~horovod_sparse.engine.horovod_tiers`). It stands above the methods and below the front ends.
"""
