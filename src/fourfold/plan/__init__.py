"""The planner: memory estimator, performance model and search. Pure arithmetic: no torch."""
