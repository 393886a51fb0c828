"""``ftrain plan``: per-rank memory of every strategy before anything runs
(:mod:`~ftrain.planning.plan`, the model of memory), per pipeline stage under each schedule
(:mod:`~ftrain.planning.plan_pipeline`), and the tables and recommendation
(:mod:`~ftrain.planning.plan_report`). Builds the model on the meta device: no memory, no GPU.
"""
