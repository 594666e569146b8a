"""NanoFlow: the op graph, profiles, the two-stage MILP auto-search, schedules."""
