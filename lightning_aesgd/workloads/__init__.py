"""Built-in workloads: datasets, models and metrics used by the main job, the examples and the benchmark."""
